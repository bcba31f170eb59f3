#!/bin/bash
# testbed/rxe-pair.sh server|client PEER_ADDR SHARED_DIR — runs in each of two guests
# (tests.sh `captures`): rxe against rxe, with perftest and ibverbs-utils as
# Debian ships them and with rdmx's NIC provider on both ends, so that a
# capture of the bridge holds every RC opcode (with immediate too), UC, UD,
# atomics, the CM MADs of rdma_cm, and sequence NAKs (a lossy run). Both
# guests run the same list in order; the client retries each command until
# the server side listens. Exit status: the number of failed commands.
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
fails=0
for c in "${cmds[@]}"; do
  lossy=""
  if [[ $c == lossy* ]]; then lossy=1; c=${c#lossy }; fi
  # 10% loss on both guests' egress: go-back-N recovery, sequence NAKs
  [[ -z $lossy ]] || tc qdisc replace dev eth0 root netem loss 10%
  echo "### $role: $c"
  # rdma_cm answers a ConnectRequest that beats the server's listener with a
  # ConnectReject, and perftest's server does not always recover from that:
  # give it a head start.
  [[ $role == client && $c == *" -R "* ]] && sleep 3
  tries=0
  while :; do
    if [[ $c == rdmx-soak ]]; then
      if [[ $role == server ]]; then
        "$rdmx" soak server --listen "0.0.0.0:7500" --transport rdma &
        srv=$!
        # until the client is done (the directory both guests share)
        timeout 120 bash -c "until [ -e $shared/soak-done ]; do sleep 0.3; done"; rc=$?
        kill $srv 2>/dev/null
      else
        timeout 120 "$rdmx" soak client "rdma://$peer:7500" --bytes 96k --chunk 4097; rc=$?
        [[ $rc != 0 ]] || touch "$shared/soak-done"
      fi
    elif [[ $role == server && $c == *" -R "* ]]; then
      # A perftest server whose rdma_cm saw a rejected early ConnectRequest
      # may wait for ever: serve again (30 s a try) until the client is done.
      rc=1
      for _ in 1 2 3 4 5; do
        [[ ! -e $shared/cm-done ]] || break
        timeout 30 $c && { rc=0; break; }
      done
    elif [[ $role == server && -n $lossy ]]; then
      # Under 10% loss perftest's client can fail after the server side
      # finished (its closing exchange): serve again until the client
      # succeeded (its retries connect to the next instance).
      rc=1
      for _ in 1 2 3 4 5; do
        timeout 60 $c && rc=0
        # The client says so within seconds when its side succeeded.
        timeout 10 bash -c "until [ -e $shared/lossy-done ]; do sleep 0.3; done" && break
      done
    elif [[ $role == server ]]; then
      timeout 120 $c; rc=$?
    else
      timeout 120 $c "$peer"; rc=$?
    fi
    [[ $rc != 0 && $role == client && $tries -lt 40 ]] || break
    tries=$((tries + 1)); sleep 0.5
    [[ $c != *" -R "* ]] || sleep 2   # the server may be restarting (above)
  done
  [[ $role != client || $c != *" -R "* || $rc != 0 ]] || touch "$shared/cm-done"
  [[ $role != client || -z $lossy || $rc != 0 ]] || touch "$shared/lossy-done"
  [[ -z $lossy ]] || tc qdisc del dev eth0 root
  echo "### $role: rc=$rc after $tries retries: $c"
  [[ $rc == 0 ]] || fails=$((fails + 1))
done
exit $fails
