#!/bin/bash
# testbed/rxe-pair.sh server|client PEER_ADDR SHARED_DIR — runs in each of two guests
# (tests.sh `captures`): rxe against rxe, with perftest and ibverbs-utils as
# Debian ships them and with rdmx's NIC provider on both ends, so that a
# capture of the bridge holds every RC opcode (with immediate too), UC, UD,
# atomics, the CM MADs of rdma_cm, and sequence NAKs (a lossy run). Both
# guests run the same list in order and meet before each command (files in
# the directory both share), so a side held up by one command never leaves
# the other running the next one alone. The client retries a command until
# it succeeds or its time is up and then says how it ended; the server
# serves the command again whenever its instance ends (a perftest server can
# exit or hang after a failed attempt of its client) until the client has
# said so. Exit status: the number of failed commands.
role=$1 peer=$2 shared=$3
pt="-d rxe0 -i 1 -x 1 -F -n 5"
rdmx=${RDMX:-target/release/rdmx}
cmds=(
  "ib_write_bw $pt -s 3000"
  "ib_write_bw $pt -s 64"
  "ib_read_bw $pt -s 3000"
  "ib_read_bw $pt -s 64"
  "ib_send_bw $pt -s 3000"
  "ib_send_bw $pt -s 64"
  "ib_send_bw $pt -c UD -s 64"
  "ib_write_bw $pt -c UC -s 3000"
  "ib_send_bw $pt -c UC -s 3000"
  "ib_atomic_bw $pt -A FETCH_AND_ADD"
  "ib_atomic_bw $pt -A CMP_AND_SWAP"
  "ib_write_bw -d rxe0 -i 1 -F -n 5 -R -s 64"
  "rdmx-soak"
  "lossy ib_write_bw -d rxe0 -i 1 -x 1 -F -n 60 -s 1100"
)
# client_done SECS: wait up to SECS seconds for the client's verdict on
# command $idx (its file in the shared directory); false if it is not there
client_done() {
  local end=$((SECONDS + $1))
  until [[ -e $shared/client-done-$idx ]]; do
    ((SECONDS < end)) || return 1
    sleep 0.3
  done
}
fails=0
other=server
[[ $role == client ]] || other=client
for idx in "${!cmds[@]}"; do
  c=${cmds[idx]}
  lossy=""
  if [[ $c == lossy* ]]; then lossy=1; c=${c#lossy }; fi
  # 10% loss on both guests' egress: go-back-N recovery, sequence NAKs
  [[ -z $lossy ]] || tc qdisc replace dev eth0 root netem loss 10%
  echo "### $role: $c"
  touch "$shared/$role-at-$idx"
  timeout 300 bash -c "until [ -e $shared/$other-at-$idx ]; do sleep 0.2; done" ||
    echo "### $role: the $other never reached: $c"
  tries=0
  if [[ $role == server ]]; then
    rc=1
    deadline=$((SECONDS + 200))
    while ! client_done 0 && ((SECONDS < deadline)); do
      if [[ $c == rdmx-soak ]]; then
        # rdmx's server keeps serving: it runs until the client is done
        "$rdmx" soak server --listen "0.0.0.0:7500" --transport rdma &
        srv=$!
        client_done 180
        kill $srv 2>/dev/null
        wait $srv 2>/dev/null
        break
      fi
      timeout 60 $c && rc=0
      # the client says how it ended within seconds of a success
      client_done 10 && break
      tries=$((tries + 1))
    done
    # the server's verdict is the client's: a served instance that failed
    # while a retry succeeded is no failure, and rdmx's server never exits
    [[ "$(cat "$shared/client-done-$idx" 2>/dev/null)" != 0 ]] || rc=0
  else
    # rdma_cm answers a ConnectRequest that beats the server's listener with
    # a ConnectReject: give the perftest server a head start
    [[ $c != *" -R "* ]] || sleep 3
    deadline=$((SECONDS + 180))
    while :; do
      if [[ $c == rdmx-soak ]]; then
        timeout 120 "$rdmx" soak client "rdma://$peer:7500" --bytes 96k --chunk 4097; rc=$?
      else
        timeout 120 $c "$peer"; rc=$?
      fi
      [[ $rc != 0 ]] && ((SECONDS < deadline)) || break
      tries=$((tries + 1)); sleep 0.5
      [[ $c != *" -R "* ]] || sleep 2   # the server may be restarting
    done
    echo "$rc" > "$shared/client-done-$idx"
  fi
  [[ -z $lossy ]] || tc qdisc del dev eth0 root
  echo "### $role: rc=$rc after $tries retries: $c"
  [[ $rc == 0 ]] || fails=$((fails + 1))
done
exit $fails
