#!/usr/bin/env python3
"""Turn the outputs of bench/run.sh into BENCHMARKS.md (stdout).

Every figure printed here is read from a file that bench/run.sh produced in the
same run; nothing is typed in by hand. Unit conversions are explicit:
- ucx_perftest latency tests of the ping-pong kind (put_lat, tag_lat) report half
  a round trip; ucp_get reports the whole operation. Its MB/s are MiB/s.
- fi_pingpong's usec/xfer is one way (half a round trip); its MB/sec counts the
  bytes of both directions, in 10^6-byte MB.
"""
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone

OUT = sys.argv[1]
MIB_TO_MB = 1.048576


def read(name, ext):
    p = os.path.join(OUT, f"{name}.{ext}")
    return open(p).read() if os.path.exists(p) else ""


def cmd(name):
    return read(name, "cmd").strip()


def rdmx(name):
    rows = []
    for line in read(name, "out").splitlines():
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def ucx(name):
    """(p50_us, overall_bw_MiB_s) from ucx_perftest -f -v output."""
    last = None
    for line in read(name, "out").splitlines():
        parts = line.strip().split(",")
        if len(parts) >= 8 and parts[0].isdigit():
            last = parts
    if not last:
        return None
    return float(last[1]), float(last[5])


def fabric(name):
    """(usec_per_xfer, MB_per_sec) from fi_pingpong's result line."""
    for line in read(name, "out").splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[0][0].isdigit() and parts[1] != "#sent":
            try:
                return float(parts[6]), float(parts[5])
            except ValueError:
                pass
    return None


def med(vals):
    """(median, spread in % of the median) of the values that exist."""
    vals = sorted(v for v in vals if v is not None)
    if not vals:
        return None, None
    m = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
    return m, (vals[-1] - vals[0]) / m * 100 if m else 0.0


def f(v, p=2):
    return "—" if v is None else f"{v:.{p}f}"


def fx(x, want):
    """A ratio set against its target `want`: two decimals, or three where
    two would round it onto the target it misses or only just meets (0.896
    shown as 0.90 beside "no" read as a mistake)."""
    if x is not None and f(x) == f(want) and x != want:
        return f(x, 3)
    return f(x)


def find(rows, op, size):
    for r in rows:
        if r["op"] == op and r["size"] == size:
            return r
    return None


def p50_meds(rounds, op, size=8):
    """(median, spread %) of `op`'s p50 and of raw TCP's over interleaved rounds."""
    pts = [p for p in (find(x, op, size) for x in rounds) if p]
    return med([p["p50_us"] for p in pts]), med([(p.get("baseline") or {}).get("p50_us") for p in pts])


def ratio_med(rounds, op, size=8):
    """(median, spread %) of `op`'s latency ratio to raw TCP over interleaved rounds."""
    return med([(find(x, op, size) or {}).get("lat_ratio") for x in rounds])


irq = rdmx("rdmx_irq")
poll = rdmx("rdmx_poll")
put_lat, get_lat, tag_lat = ucx("ucx_put_lat"), ucx("ucx_get_lat"), ucx("ucx_tag_lat")
put_sleep = ucx("ucx_put_lat_sleep")
put_bw, get_bw = ucx("ucx_put_bw_1m"), ucx("ucx_get_bw_1m")
tag_bw_runs = [x for x in (ucx(f"ucx_tag_bw_1m_r{r}") for r in (1, 2, 3)) if x]
# (median MB/s, spread %) of UCX tag_bw, and of each rdmx streaming op.
tag_bw = med([x[1] * MIB_TO_MB for x in tag_bw_runs]) if tag_bw_runs else None
stream_runs = [x for x in (rdmx(f"rdmx_stream_r{r}") for r in (1, 2, 3)) if x]
stream = {op: med([(find(run_, op, 1048576) or {}).get("mb_per_s") for run_ in stream_runs])
          for op in ("write", "read", "send")}
# The same reads into a registered region of the client (`--into-region`).
stream_into_runs = [x for x in (rdmx(f"rdmx_stream_into_r{r}") for r in (1, 2, 3)) if x]
stream_into = med([(find(run_, "read", 1048576) or {}).get("mb_per_s") for run_ in stream_into_runs])
# The same writes and reads with a buffer per operation in flight (`--slots 16`).
stream16_runs = [x for x in (rdmx(f"rdmx_stream_slots16_r{r}") for r in (1, 2, 3)) if x]
stream16 = {op: med([(find(run_, op, 1048576) or {}).get("mb_per_s") for run_ in stream16_runs])
            for op in ("write", "read")}
# Client CPU µs per read, (median, spread %), into new bytes and into the region.
stream_cpu = {
    name: med([(find(run_, "read", 1048576) or {}).get("cpu_us_per_op") for run_ in runs])
    for name, runs in (("bytes", stream_runs), ("region", stream_into_runs))
}
fi8, fi1m = fabric("fi_pingpong_8"), fabric("fi_pingpong_1m")

# The commit measured and when the run began (bench/run.sh writes them to
# run.info); the checkout's and the clock's for results without one.
# A third line names the TCP congestion control the run used (older runs
# have none).
try:
    info = open(os.path.join(OUT, "run.info")).read().split("\n")
    commit, now = info[:2]
    cc = info[2].strip() if len(info) > 2 else ""
except (OSError, ValueError):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cc = ""
cpus = os.cpu_count()

o = []
w = o.append
w("# rdmx benchmarks\n")
w(f"Measured by `bash bench/run.sh` from {now}, commit `{commit}`, on {platform.system()} "
  f"{platform.release()} with {cpus} CPUs. All peers run on 127.0.0.1 on this machine, in the "
  "same run. Do not edit by hand: re-run the script.\n")
if cc:
    w(f"Every TCP connection in the run, rdmx's and each baseline's, uses the `{cc}` congestion "
      "control, in a network namespace of the script's own (`BENCH_CC` picks another). Under BBR, "
      "this VM's default, loopback TCP is paced at a rate each connection settles on by chance, "
      "and a 1 MiB round trip took either about 200 µs or about 500 µs, raw TCP and rdmx alike.\n")
try:
    doctor = json.loads(read("doctor", "out") or "{}")
except ValueError:
    doctor = {}
wake = doctor.get("wake") or {}
if wake.get("cross_cpu_us"):
    w(f"This host wakes a sleeping thread in {wake['same_cpu_us']:.1f} µs per round trip with both "
      f"threads on one CPU and in {wake['cross_cpu_us']:.1f} µs across CPUs (median of "
      f"{wake['rounds']}, `{cmd('doctor')}`): every hop from one process to another on a "
      f"different CPU pays about {wake['cross_cpu_us'] / 2:.0f} µs before any work is done, so "
      "the rows where a request crosses more processes than its baseline's (the KV gateway and "
      "its nodes against redis-server, the NBD export and its target against qemu-nbd) pay it "
      "once per extra hop."
      + (" This guest's idle vCPUs halt at once (cpuidle `haltpoll`, `guest_halt_poll_ns` 0), so "
         "each of those wake-ups is a VM exit and entry; the script leaves that setting as it "
         "finds it." if doctor.get("cpuidle_driver") == "haltpoll"
         and doctor.get("guest_halt_poll_ns") == 0 else "")
      + "\n")
w("Latency figures are **round trips** of one operation (p50, microseconds). "
  "`raw-tcp` is a plain tokio socket doing the same request/response shape as the operation "
  "(8-byte header, no framing, no flow control), written as a careful TCP program is: both ends "
  "receive into a buffer, and what goes together (the requests a window allows, the answers to "
  "requests read together) leaves in one call; `rdmx perf` corks the operations it replaces "
  "together likewise. It runs interleaved with rdmx so both see the same machine conditions. *interrupt* mode sleeps in epoll; *busy-poll* spins on the socket "
  "before sleeping (rdmx `--busy-poll-us 100`; UCX and libfabric always poll).\n")

w("## rdmx over TCP against raw TCP (interrupt mode)\n")
w(f"Command: `{cmd('rdmx_irq')}`\n")
w("CPU µs/op is the process's CPU time per operation of the bandwidth run, both ends counted "
  "(`--loopback` runs them in one process), rdmx's and the raw baseline's.\n")
w("| op | size | p50 µs | p99 µs | raw p50 µs | latency × raw | MB/s | raw MB/s | bandwidth × raw | ops/s | CPU µs/op | raw CPU µs/op | CPU × raw |")
w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in irq:
    b = r.get("baseline") or {}
    w(f"| {r['op']} | {r['size']} | {f(r['p50_us'])} | {f(r['p99_us'])} | {f(b.get('p50_us'))} | "
      f"{f(r.get('lat_ratio'))} | {f(r['mb_per_s'], 1)} | {f(b.get('mb_per_s'), 1)} | "
      f"{f(r.get('bw_ratio'))} | {f(r['ops_per_s'], 0)} | {f(r.get('cpu_us_per_op'))} | "
      f"{f(b.get('cpu_us_per_op'))} | {f(r.get('cpu_ratio'))} |")
w("")

w("## 8-byte round trips against UCX and libfabric\n")
w("| peer | mode | operation | p50 round trip µs | source |")
w("|---|---|---|---:|---|")
for mode, rows in (("interrupt", irq), ("busy-poll", poll)):
    for op in ("send", "write", "read", "cas", "faa"):
        r = find(rows, op, 8)
        if r:
            b = r.get("baseline") or {}
            w(f"| rdmx tcp | {mode} | {op} | {f(r['p50_us'])} | `rdmx_{'irq' if mode == 'interrupt' else 'poll'}` |")
            w(f"| raw TCP | {mode} | same shape as {op} | {f(b.get('p50_us'))} | same run, interleaved |")
if put_lat:
    w(f"| UCX 1.x tcp | poll | ucp_put_lat (2 × reported half-RTT) | {f(2 * put_lat[0])} | `{cmd('ucx_put_lat')}` |")
if put_sleep:
    w(f"| UCX tcp | sleep | ucp_put_lat (2 × reported half-RTT) | {f(2 * put_sleep[0])} | `{cmd('ucx_put_lat_sleep')}` |")
if get_lat:
    w(f"| UCX tcp | poll | ucp_get | {f(get_lat[0])} | `{cmd('ucx_get_lat')}` |")
if tag_lat:
    w(f"| UCX tcp | poll | tag_lat (2 × reported half-RTT) | {f(2 * tag_lat[0])} | `{cmd('ucx_tag_lat')}` |")
if fi8:
    w(f"| libfabric tcp | poll | fi_pingpong msg (2 × usec/xfer) | {f(2 * fi8[0])} | `{cmd('fi_pingpong_8')}` |")
w("")

w("## 1 MiB bandwidth\n")
w("| peer | operation | MB/s (10^6 B) | source |")
w("|---|---|---:|---|")
for op in ("write", "read", "send"):
    r = find(irq, op, 1048576)
    if r:
        w(f"| rdmx tcp | {op}, 16 in flight | {f(r['mb_per_s'], 1)} | `rdmx_irq` |")
        b = r.get("baseline") or {}
        w(f"| raw TCP | same shape as {op}, 16 in flight | {f(b.get('mb_per_s'), 1)} | same run |")
if put_bw:
    w(f"| UCX tcp | ucp_put_bw | {f(put_bw[1] * MIB_TO_MB, 1)} | `{cmd('ucx_put_bw_1m')}` |")
if get_bw:
    w(f"| UCX tcp | ucp_get, 16 outstanding | {f(get_bw[1] * MIB_TO_MB, 1)} | `{cmd('ucx_get_bw_1m')}` |")
if tag_bw:
    w(f"| UCX tcp | tag_bw (tagged send/receive), median of {len(tag_bw_runs)} | "
      f"{f(tag_bw[0], 1)} | `{cmd('ucx_tag_bw_1m_r1')}` |")
for op, (mine, spread) in stream.items():
    if mine:
        w(f"| rdmx tcp, two processes (UCX's shape) | {op}, 16 in flight, median of {len(stream_runs)} "
          f"(±{f(spread, 0)}%) | {f(mine, 1)} | `{cmd('rdmx_stream_r1')}` |")
if stream_into[0]:
    w(f"| rdmx tcp, two processes (UCX's shape) | read into a registered region (`read_into`), 16 in "
      f"flight, median of {len(stream_into_runs)} (±{f(stream_into[1], 0)}%) | {f(stream_into[0], 1)} | "
      f"`{cmd('rdmx_stream_into_r1')}` |")
for op, (mine, spread) in stream16.items():
    if mine:
        w(f"| rdmx tcp, two processes, a 1 MiB buffer per operation in flight (`--slots 16`) | "
          f"{op}, 16 in flight, median of {len(stream16_runs)} (±{f(spread, 0)}%) | {f(mine, 1)} | "
          f"`{cmd('rdmx_stream_slots16_r1')}` |")
if fi1m:
    w(f"| libfabric tcp | fi_pingpong msg (both directions counted) | {f(fi1m[1], 1)} | `{cmd('fi_pingpong_1m')}` |")
w("")
if stream_runs and all((find(x, "write", 1048576) or {}).get("slots") == 1 for x in stream_runs):
    w("The two-process rows compare like with like: as ucx_perftest allocates one send and one "
      "receive buffer and runs every message in flight through them, rdmx's run puts every "
      "operation on one 1 MiB slot of each side (`--slots 1`). The `--slots 16` row gives each "
      "operation in flight its own slot (16 MiB on the server), which the caches hold less of.\n")
if stream_cpu["bytes"][0] and stream_cpu["region"][0]:
    w(f"Client CPU per 1 MiB read in those two-process runs (medians): "
      f"{f(stream_cpu['bytes'][0], 1)} µs (±{f(stream_cpu['bytes'][1], 0)}%) into new owned bytes, "
      f"{f(stream_cpu['region'][0], 1)} µs (±{f(stream_cpu['region'][1], 0)}%) into a registered region "
      f"(TCP receives a large answer straight into the region's slice).\n")

w("## Targets (issue 2), checked by the script\n")
w("| target | measured | met |")
w("|---|---|---|")


def target(name, measured, ok):
    w(f"| {name} | {measured} | {'yes' if ok else 'no' if ok is not None else 'not measured'} |")


for mode, rows, key in (("interrupt", irq, "irq"), ("busy-poll", poll, "poll")):
    # Medians of the interleaved 8 B rounds where the run has them (a single
    # run of a 15 µs round trip moves by a fifth on this VM), else the sweep.
    rounds = [x for x in (rdmx(f"rdmx_lat8_{key}_r{r}") for r in (1, 2, 3)) if x]
    for op in ("send", "write", "read"):
        if rounds:
            ratio, spread = ratio_med(rounds, op)
            measured = f"{f(ratio)} × (median of {len(rounds)}, ±{f(spread, 0)}%)"
        else:
            r = find(rows, op, 8)
            ratio = r.get("lat_ratio") if r else None
            measured = f"{f(ratio)} ×"
        target(f"8 B {op} round trip ≤ 1.2 × raw TCP ({mode})", measured,
               None if ratio is None else ratio <= 1.2)
best_w = min([x for x in (find(irq, "write", 8), find(poll, "write", 8)) if x], key=lambda r: r["p50_us"], default=None)
best_r = min([x for x in (find(irq, "read", 8), find(poll, "read", 8)) if x], key=lambda r: r["p50_us"], default=None)
if put_lat and best_w:
    target("8 B write round trip below UCX put", f"{f(best_w['p50_us'])} µs vs {f(2 * put_lat[0])} µs",
           best_w["p50_us"] < 2 * put_lat[0])
if get_lat and best_r:
    target("8 B read round trip below UCX get", f"{f(best_r['p50_us'])} µs vs {f(get_lat[0])} µs",
           best_r["p50_us"] < get_lat[0])
ucx_best = max([x[1] * MIB_TO_MB for x in (put_bw, get_bw) if x], default=None)
for op in ("write", "read"):
    r = find(irq, op, 1048576)
    if r and ucx_best:
        target(f"1 MiB {op} bandwidth ≥ UCX's best 1 MiB figure",
               f"{f(r['mb_per_s'], 1)} vs {f(ucx_best, 1)} MB/s", r["mb_per_s"] >= ucx_best)
if rdmx("rdmx_lat8_irq_r1"):
    w("\nThe 8 B round-trip targets are medians of the per-round ratios to raw TCP over interleaved rounds of "
      f"`{cmd('rdmx_lat8_irq_r1')}` and `{cmd('rdmx_lat8_poll_r1')}`.")
w("")

rdma = rdmx("rdmx_rdma")
# Soft RoCE 8 B round trips, interleaved `--mode lat` rounds: their medians
# decide the target (the sweep's single 8 B point moves by a third between
# runs on this VM).
soft_rounds = [x for x in (rdmx(f"rdmx_rdma_lat8_r{r}") for r in (1, 2, 3)) if x]


def window_rows(p, op):
    """The rounds' rows of 1 MiB `op`s, 16 in flight, selective repeat, at `p`
    permille loss (rounds that produced none are left out)."""
    rows = (find(rdmx(f"loss_window_{p}_r{r}"), op, 1 << 20) for r in (1, 2, 3))
    return [row for row in rows if row]


def window_goodput(p, op):
    """(median MB/s, spread %, rounds) of the `window_rows`."""
    vals = [row["mb_per_s"] for row in window_rows(p, op) if row.get("mb_per_s")]
    return med(vals) + (len(vals),)


def window_counters(p, op):
    """Medians over the rounds of the protocol counters (retransmits, timer
    expiries, NAKs) of the `window_rows`; None where the rows carry none (a run
    before rdmx perf reported them)."""
    cs = [row["rdma"] for row in window_rows(p, op) if row.get("rdma")]
    if not cs:
        return None
    return tuple(med([c[k] for c in cs])[0] for k in ("retransmits", "retransmit_timeouts", "naks"))


def soak(name):
    rows = rdmx(name)
    if not rows:
        return None
    r = dict(rows[0])
    # RDMA runs carry their protocol counters under "rdma"; TCP runs have none.
    r.update(r.get("rdma") or {"retransmits": 0, "naks": 0, "rnr_naks": 0, "cnps": 0, "ce_marked": 0})
    return r


w("## Soft RoCE: the rdma transport on the userspace RoCEv2 engine\n")
w("Real RoCEv2 packets over UDP port 4791 on loopback (the engine in this process, both "
  "ends on this machine's cores), against raw TCP in the same run and the TCP transport "
  "(`rdmx_irq` above).\n")
w(f"Command: `{cmd('rdmx_rdma')}`\n")
w("| op | size | p50 µs | p99 µs | raw TCP p50 µs | latency × raw | MB/s | rdmx tcp MB/s | × rdmx tcp |")
w("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rdma:
    b = r.get("baseline") or {}
    t = find(irq, r["op"], r["size"])
    tcp_bw = t["mb_per_s"] if t else None
    x = r["mb_per_s"] / tcp_bw if (r["mb_per_s"] and tcp_bw) else None
    w(f"| {r['op']} | {r['size']} | {f(r['p50_us'])} | {f(r['p99_us'])} | {f(b.get('p50_us'))} | "
      f"{f(r.get('lat_ratio'))} | {f(r['mb_per_s'], 1)} | {f(tcp_bw, 1)} | {f(x)} |")
w("")
if soft_rounds:
    w(f"8 B round trips, {len(soft_rounds)} rounds interleaved with the TCP rounds above "
      f"(`{cmd('rdmx_rdma_lat8_r1')}`): median p50 and latency × raw TCP, with the spread "
      "(max − min, % of the median).\n")
    w("| op | p50 µs | raw TCP p50 µs | latency × raw |")
    w("|---|---:|---:|---:|")
    for op in ("send", "write", "read", "cas", "faa"):
        p50, raw = p50_meds(soft_rounds, op)
        ratio = ratio_med(soft_rounds, op)
        w(f"| {op} | {f(p50[0])} ±{f(p50[1], 0)}% | {f(raw[0])} ±{f(raw[1], 0)}% | "
          f"{f(ratio[0])} ±{f(ratio[1], 0)}% |")
    w("")

LANES = (1, 2, 4)
if any(rdmx(f"lanes_tcp_1_r{r}") for r in (1, 2, 3)):
    w("## Lanes: one connection over several TCP connections or RC queue pairs\n")
    w("`rdmx perf --lanes N`: large reads and writes split by remote address across N lanes "
      "(256 KiB units), loopback, both ends in one process on this VM's two cores. Three rounds, "
      "interleaved; medians with the spread (max − min, % of the median). p50: one operation "
      "at a time; MB/s: 16 in flight.\n")
    w(f"Command: `{cmd('lanes_tcp_4_r1')}` (likewise for 1 and 2 lanes and `--transport rdma`)\n")
    w("| transport | op | size | " + " | ".join(f"{n} lane{'s' if n > 1 else ''} MB/s" for n in LANES)
      + " | " + " | ".join(f"{n} p50 µs" for n in LANES) + " | 4 ÷ 1 lanes MB/s |")
    w("|---|---|---:|" + "---:|" * (2 * len(LANES) + 1))
    for t, label in (("tcp", "tcp"), ("rdma", "soft RoCE")):
        for op in ("write", "read"):
            for size in (1 << 20, 16 << 20):
                bw, lat = {}, {}
                for n in LANES:
                    pts = [find(rdmx(f"lanes_{t}_{n}_r{r}"), op, size) for r in (1, 2, 3)]
                    bw[n] = med([p["mb_per_s"] for p in pts if p])
                    lat[n] = med([p["p50_us"] for p in pts if p])
                x = bw[4][0] / bw[1][0] if bw[4][0] and bw[1][0] else None
                w(f"| {label} | {op} | {size >> 20} MiB | "
                  + " | ".join(f"{f(bw[n][0], 1)} ±{f(bw[n][1], 0)}%" for n in LANES) + " | "
                  + " | ".join(f"{f(lat[n][0], 1)}" for n in LANES) + f" | {f(x)} |")
    w("")
if rdma:
    w(f"Provider: `{rdma[0]['provider']}`.\n")
rdma_poll = rdmx("rdmx_rdma_poll")
if rdma_poll:
    w("### Soft RoCE with adaptive busy polling, 8 B\n")
    w("`Options::busy_poll` makes the completion-queue waiter poll before sleeping, for a "
      "budget that halves when spinning finds nothing and grows when completions come soon "
      "after a sleep (the same code serves NIC completion queues). The raw TCP baseline "
      "spins on its socket in this mode too. With soft RoCE the completions come from the "
      "engine's own tasks on the same two cores as the spinning waiter, so this measures "
      "the mechanism, not what a NIC gains from it.\n")
    w(f"Command: `{cmd('rdmx_rdma_poll')}`\n")
    w("| op | p50 µs | p99 µs | raw TCP p50 µs | latency × raw | interrupt-mode p50 µs | × interrupt mode |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    for r in rdma_poll:
        b = r.get("baseline") or {}
        i = find(rdma, r["op"], r["size"])
        ip50 = i["p50_us"] if i else None
        x = r["p50_us"] / ip50 if (r.get("p50_us") and ip50) else None
        w(f"| {r['op']} | {f(r['p50_us'])} | {f(r['p99_us'])} | {f(b.get('p50_us'))} | "
          f"{f(r.get('lat_ratio'))} | {f(ip50)} | {f(x)} |")
    w("")

sr = {p: soak(f"soak_sr_{p}") for p in (0, 1, 10, 50)}
gbn = {p: soak(f"soak_gbn_{p}") for p in (0, 1, 10, 50)}
tcp0 = soak("soak_tcp_0")
if sr[0]:
    w("## Goodput under packet loss (two namespaces, veth, nftables)\n")
    w("`rdmx soak` moves a mix of writes read back, writes with immediate, sends and atomics, "
      "with every byte and returned value checked, one 1 MiB operation at a time, between two network namespaces joined by a veth pair "
      "(MTU 1500, so RoCE path MTU 1024). nftables drops the given share of UDP 4791 packets "
      "in each direction; the lossless runs (0%) pass through the same rule, which then drops "
      "nothing, so that every ratio to them measures the loss, not the rule's own per-packet "
      "cost (the next table's \"no rule\" row shows that cost). Selective repeat is rdmx's negotiated extension; go-back-N is what "
      "NICs speak. GSO is off on the veth so that nftables sees single packets; that costs "
      "the TCP transport far more than soft RoCE (see the loopback tables for TCP at full "
      "speed).\n")
    w(f"Commands: `{cmd('soak_sr_10')}` (selective repeat), `{cmd('soak_gbn_10')}` (go-back-N), "
      f"`{cmd('soak_tcp_0')}` (TCP transport, no loss).\n")
    w("| loss | mode | goodput MB/s | × own lossless | retransmits | NAKs |")
    w("|---:|---|---:|---:|---:|---:|")
    if tcp0:
        w(f"| 0 | tcp transport | {f(tcp0['goodput_mb_per_s'], 1)} | — | — | — |")
    for p in (0, 1, 10, 50):
        for name, d in (("selective repeat", sr), ("go-back-N", gbn)):
            r, base = d[p], d[0]
            if r:
                x = r["goodput_mb_per_s"] / base["goodput_mb_per_s"] if base else None
                w(f"| {p / 10:.1f}% | {name} | {f(r['goodput_mb_per_s'], 1)} | {f(x)} | "
                  f"{r['retransmits']} | {r['naks']} |")
    w("")
    if rdmx("loss_window_0_r1"):
        w("### A full window: 16 operations of 1 MiB in flight\n")
        w("The same veth and nftables rules; `rdmx perf` keeps 16 writes, then 16 reads, of 1 MiB in flight "
          "(selective repeat), for 2 s each, three rounds interleaved over the loss rates: median MB/s, "
          "spread = (max − min) / median. The protocol counters are the client's for one 2 s run "
          "(medians over the rounds): packets resent (READs: ranges asked again), retransmission "
          "timer expiries, NAKs received. The \"no rule\" rows run with the nftables chain "
          "empty: against the lossless rows (the same rule, dropping nothing) they show what "
          "the loss injector itself costs.\n")
        w(f"Command: `{cmd('loss_window_10_r1')}`\n")
        w("| loss | op | MB/s | spread | rounds | × lossless | retransmits | timer expiries | NAKs |")
        w("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for p in ("none", 0, 10, 50):
            for op in ("write", "read"):
                (v, s_, n), (c, _, _) = window_goodput(p, op), window_goodput(0, op)
                k = window_counters(p, op)
                ks = " | ".join(f"{x:.0f}" for x in k) if k else "— | — | —"
                loss = "0% (no rule)" if p == "none" else f"{p / 10:.1f}%"
                if v:
                    w(f"| {loss} | {op} | {f(v, 1)} | {f(s_, 0)}% | {n} | {f(v / c) if c else '—'} | {ks} |")
        w("")

# rpc_bench runs each point (size, calls in flight) on every system in turn;
# its table lists the systems one after another, in the order it sets them up.
RPC_SYSTEMS = ("rdmx-rpc/tcp", "rdmx-rpc/tcp-uncoalesced", "rdmx-rpc/soft-roce",
               "tonic/tcp", "tonic/rdmx-tcp", "tonic/rdmx-soft-roce")
rpc = sorted(rdmx("rpc_bench") or [],
             key=lambda r: (RPC_SYSTEMS.index(r["system"]) if r["system"] in RPC_SYSTEMS
                            else len(RPC_SYSTEMS), r["size"], r["concurrency"]))
load = {}  # system -> (median QPS, spread %, p99, CPU µs/call, writes/call) under load
if rpc:
    w("## RPC: rdmx-rpc against tonic\n")
    w("Unary echo (the body comes back), one connection, `concurrency` calls in flight. "
      "rdmx-rpc bodies above 64 KiB travel by rendezvous (one-sided read). tonic runs with "
      "TCP_NODELAY on both ends; `tonic/rdmx-*` is the unmodified tonic service and client "
      "over an rdmx connection (`rdmx-rpc-tonic`).\n")
    w("CPU µs/call is this process's user + system CPU time (client and server run in it) per call; "
      "writes/call counts its write-family system calls (`write`, `writev`: `syscw` of /proc/self/io; "
      "socket reads are not counted there). `rdmx-rpc/tcp-uncoalesced` is rdmx-rpc with frame "
      "coalescing off (`ServerOptions::coalesce`, `Client::set_coalescing`): one send per frame, "
      "as before coalescing existed. Each point (size, calls in flight) runs on every system in "
      "turn, each point starting one system further along, so that the systems compared at a "
      "point are measured within seconds of each other, not a whole sweep apart.\n")
    w(f"Command: `{cmd('rpc_bench')}`\n")
    w("| system | size | concurrency | QPS | p50 µs | p99 µs | MB/s | CPU µs/call | writes/call |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rpc:
        w(f"| {r['system']} | {r['size']} | {r['concurrency']} | {f(r['qps'], 0)} | {f(r['p50_us'])} | "
          f"{f(r['p99_us'])} | {f(r['mb_per_s'], 1)} | {f(r.get('cpu_us_per_call'))} | "
          f"{f(r.get('writes_per_call'), 3)} |")
    w("")
    loads = [rdmx(f"rpc_load_r{i}") for i in (1, 2, 3)]
    loads = [x for x in loads if x]
    if loads:
        w(f"### Under load, three runs back to back\n")
        w(f"Command: `{cmd('rpc_load_r1')}` (three times). Median over the runs; spread = (max − min) / median.\n")
        w("| system | QPS | spread | p99 µs | CPU µs/call | writes/call |")
        w("|---|---:|---:|---:|---:|---:|")
        for system in ("rdmx-rpc/tcp", "rdmx-rpc/tcp-uncoalesced", "tonic/tcp"):
            pts = [r for run_ in loads for r in run_ if r["system"] == system]
            if not pts:
                continue
            q, spread = med([p["qps"] for p in pts])
            p99, _ = med([p["p99_us"] for p in pts])
            cpu, _ = med([p.get("cpu_us_per_call") for p in pts])
            wr, _ = med([p.get("writes_per_call") for p in pts])
            load[system] = (q, spread, p99, cpu, wr)
            w(f"| {system} | {f(q, 0)} | {f(spread, 0)}% | {f(p99)} | {f(cpu)} | {f(wr, 3)} |")
        w("")


def rpc_point(system, size, conc):
    for r in rpc:
        if r["system"] == system and r["size"] == size and r["concurrency"] == conc:
            return r
    return None


w("## Targets (issue 3), checked by the script\n")
w("| target | measured | met |")
w("|---|---|---|")
bw1m = [(x, y) for x, y in ((rdmx(f"rdmx_bw1m_tcp_r{r}"), rdmx(f"rdmx_bw1m_rdma_r{r}")) for r in (1, 2, 3)) if x and y]
for op in ("write", "read"):
    if bw1m:
        # Interleaved rounds: the median of the per-round ratios.
        pairs = [(find(y, op, 1048576), find(x, op, 1048576)) for x, y in bw1m]
        pairs = [(r["mb_per_s"], t["mb_per_s"]) for r, t in pairs if r and t]
        x, spread = med([a / b for a, b in pairs])
        ra, _ = med([a for a, _ in pairs])
        ta, _ = med([b for _, b in pairs])
        if x is not None:
            target(f"soft RoCE 1 MiB {op} ≥ 0.5 × the TCP transport (median of {len(pairs)}, interleaved)",
                   f"{fx(x, 0.5)} × ±{f(spread, 0)}% ({f(ra, 1)} vs {f(ta, 1)} MB/s)", x >= 0.5)
        continue
    r, t = find(rdma, op, 1048576), find(irq, op, 1048576)
    if r and t:
        x = r["mb_per_s"] / t["mb_per_s"]
        target(f"soft RoCE 1 MiB {op} ≥ 0.5 × the TCP transport", f"{fx(x, 0.5)} × ({f(r['mb_per_s'], 1)} vs {f(t['mb_per_s'], 1)} MB/s)", x >= 0.5)
if sr[0] and sr[10]:
    x = sr[10]["goodput_mb_per_s"] / sr[0]["goodput_mb_per_s"]
    g = gbn[10]["goodput_mb_per_s"] / gbn[0]["goodput_mb_per_s"] if gbn[0] and gbn[10] else None
    target("1% loss, selective repeat ≥ 0.8 × its lossless goodput",
           f"{f(x)} × (go-back-N: {f(g)} ×; retransmits SR {sr[10]['retransmits']} vs GBN {gbn[10]['retransmits'] if gbn[10] else '—'})",
           x >= 0.8)
if bw1m:
    w(f"\nThe soft RoCE 1 MiB targets: rounds of `{cmd('rdmx_bw1m_tcp_r1')}` and `{cmd('rdmx_bw1m_rdma_r1')}`, "
      "interleaved; the median of the per-round ratios.")
w("")
if rpc:
    w("## Targets (issue 5), checked by the script\n")
    w("| target | measured | met |")
    w("|---|---|---|")
    for conc in (1, 64):
        a, b = rpc_point("rdmx-rpc/tcp", 64, conc), rpc_point("tonic/tcp", 64, conc)
        if a and b:
            x = a["qps"] / b["qps"]
            target(f"64 B, {conc} in flight: rdmx-rpc/tcp ≥ 3 × tonic QPS, lower p99",
                   f"{f(x)} × QPS; p99 {f(a['p99_us'])} vs {f(b['p99_us'])} µs",
                   x >= 3 and a["p99_us"] < b["p99_us"])
        a, b = rpc_point("rdmx-rpc/tcp", 1048576, conc), rpc_point("tonic/tcp", 1048576, conc)
        if a and b:
            target(f"1 MiB, {conc} in flight: rdmx-rpc/tcp throughput ≥ tonic's",
                   f"{f(a['mb_per_s'], 1)} vs {f(b['mb_per_s'], 1)} MB/s", a["mb_per_s"] >= b["mb_per_s"])
    w("")
tonic_runs = [x for x in (rdmx(f"rpc_tonic_r{i}") for i in (1, 2, 3)) if x]
tonic = {}
if tonic_runs:
    w("### tonic over rdmx against tonic over TCP, three runs back to back\n")
    w(f"Command: `{cmd('rpc_tonic_r1')}` (three times). The unmodified tonic echo service and "
      "client; QPS is the median over the runs, spread = (max − min) / median, × tonic/tcp is "
      "the ratio of medians.\n")
    w("| system | size | concurrency | QPS | spread | MB/s | × tonic/tcp |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    points = sorted({(r["size"], r["concurrency"]) for run_ in tonic_runs for r in run_})
    for system in ("tonic/tcp", "tonic/rdmx-tcp", "tonic/rdmx-soft-roce"):
        for size, conc in points:
            pts = [r for run_ in tonic_runs for r in run_
                   if r["system"] == system and r["size"] == size and r["concurrency"] == conc]
            if not pts:
                continue
            q, spread = med([p["qps"] for p in pts])
            mb, _ = med([p["mb_per_s"] for p in pts])
            tonic[(system, size, conc)] = q
            base = tonic.get(("tonic/tcp", size, conc))
            x = f(q / base) if base else "—"
            w(f"| {system} | {size} | {conc} | {f(q, 0)} | {f(spread, 0)}% | {f(mb, 1)} | {x} |")
    w("")
w("## Targets (issue 14), checked by the script\n")
w("| target | measured | met |")
w("|---|---|---|")
if tag_bw:
    ucx_tag, ucx_spread = tag_bw
    for op, (mine, spread) in stream.items():
        if mine:
            target(f"1 MiB, 16 in flight, two processes: rdmx tcp {op} ≥ UCX tag_bw over TCP "
                   f"(medians of {len(stream_runs)})",
                   f"{f(mine / ucx_tag)} × ({f(mine, 1)} ±{f(spread, 0)}% vs {f(ucx_tag, 1)} "
                   f"±{f(ucx_spread, 0)}% MB/s)", mine >= ucx_tag)
# Medians of the interleaved 1 MiB rounds where the run has them (a single
# run's raw TCP p50 moves between 180 and 550 µs on this VM), else the sweep.
rounds_1m = [x for x in (rdmx(f"rdmx_lat1m_r{r}") for r in (1, 2, 3)) if x]
for op in ("write", "read"):
    if rounds_1m:
        ratio, spread = ratio_med(rounds_1m, op, 1 << 20)
        (p50, _), (raw, _) = p50_meds(rounds_1m, op, 1 << 20)
        measured = (f"{f(ratio)} × (median of {len(rounds_1m)}, ±{f(spread, 0)}%; "
                    f"p50 {f(p50)} vs {f(raw)} µs)")
    else:
        r = find(irq, op, 1 << 20) or {}
        ratio = r.get("lat_ratio")
        measured = (f"{f(ratio)} × ({f(r.get('p50_us'))} vs "
                    f"{f((r.get('baseline') or {}).get('p50_us'))} µs)")
    if ratio is not None:
        target(f"1 MiB single {op} p50 ≤ 1.3 × raw TCP", measured, ratio <= 1.3)
soft_8 = []
for op in ("send", "write", "read", "cas", "faa"):
    if soft_rounds:
        ratio, spread = ratio_med(soft_rounds, op)
        soft_8.append((op, ratio, f" ±{f(spread, 0)}%"))
    else:
        r = find(rdma, op, 8)
        soft_8.append((op, r.get("lat_ratio") if r else None, ""))
soft_8 = [x for x in soft_8 if x[1]]
if soft_8:
    worst = max(soft_8, key=lambda x: x[1])
    how = f" (medians of {len(soft_rounds)} interleaved rounds)" if soft_rounds else ""
    target(f"soft RoCE 8 B round trip ≤ 1.3 × raw TCP for every op{how}",
           f"worst {worst[0]} {f(worst[1])} ×; " + ", ".join(f"{op} {f(x)}{s}" for op, x, s in soft_8),
           worst[1] <= 1.3)
def sr_goodput(p):
    """(median MB/s, spread %, rounds) of selective repeat at `p` permille loss."""
    runs = [soak(f"soak_sr_{p}")] + [soak(f"soak_sr_{p}_r{r}") for r in (2, 3)]
    vals = [r["goodput_mb_per_s"] for r in runs if r]
    return med(vals) + (len(vals),)


def loss_target(what, want, lossy_med, clean_med):
    """A loss target: the lossy median goodput against the lossless one."""
    (lossy, ls, n), (clean, cs, n0) = lossy_med, clean_med
    if lossy and clean:
        x = lossy / clean
        target(f"{what} ≥ {want} × its lossless goodput (medians of {min(n, n0)})",
               f"{fx(x, want)} × ({f(lossy, 1)} ±{f(ls, 0)}% vs {f(clean, 1)} ±{f(cs, 0)}% MB/s)",
               x >= want)


for p, want in ((10, 0.9), (50, 0.6)):
    for op in ("write", "read"):
        loss_target(f"{p / 10:g}% loss, 1 MiB {op}s, 16 in flight, selective repeat", want,
                    window_goodput(p, op), window_goodput(0, op))
    loss_target(f"{p / 10:g}% loss, `rdmx soak` (one checked operation at a time), selective repeat",
                want, sr_goodput(p), sr_goodput(0))
if rpc and load:
    a, u, t = load.get("rdmx-rpc/tcp"), load.get("rdmx-rpc/tcp-uncoalesced"), load.get("tonic/tcp")
    if a and t:
        x = a[0] / t[0]
        target("64 B, 64 in flight: rdmx-rpc/tcp ≥ 3 × tonic/tcp QPS (median of 3)",
               f"{fx(x, 3)} × ({f(a[0], 0)} ±{f(a[1], 0)}% vs {f(t[0], 0)} ±{f(t[1], 0)}%)", x >= 3)
    if a and u:
        target("coalescing cuts CPU per call (64 B, 64 in flight)",
               f"{f(a[3])} vs {f(u[3])} µs uncoalesced", a[3] < u[3])
        target("coalescing cuts write system calls per call (64 B, 64 in flight)",
               f"{f(a[4], 3)} vs {f(u[4], 3)} uncoalesced", a[4] < u[4])
    for system, want in (("tonic/rdmx-soft-roce", 0.8), ("tonic/rdmx-tcp", 1.0)):
        ratios = [(size, conc, tonic[(system, size, conc)] / b)
                  for (s_, size, conc), b in tonic.items()
                  if s_ == "tonic/tcp" and (system, size, conc) in tonic]
        if ratios:
            worst = min(ratios, key=lambda r: r[2])
            target(f"{system} ≥ {want} × tonic/tcp QPS at every size and concurrency (medians of 3)",
                   f"worst {f(worst[2])} × ({worst[0]} B, {worst[1]} in flight); best "
                   f"{f(max(r[2] for r in ratios))} ×", worst[2] >= want)
w("")
if rounds_1m:
    w(f"The 1 MiB single-operation targets are medians of the per-round ratios to raw TCP over "
      f"interleaved rounds of `{cmd('rdmx_lat1m_r1')}`.\n")
if sr[0] or rdmx("loss_window_0_r1"):
    w("The loss targets' lossless goodput runs through the same nftables rule as the lossy "
      "runs, dropping nothing (see \"Goodput under packet loss\").\n")
SVG = os.environ.get("BENCH_SVG", "bench/perf-tcp.svg")
w(f"![latency and bandwidth against size]({SVG})\n")
w(f"`{SVG}` is drawn by `rdmx perf --loopback --baseline raw-tcp --op write,read --svg {SVG}` in the same run.\n")


def redis_csv(name):
    """redis-benchmark --csv: test, rps, avg, min, p50, p95, p99, max (ms)."""
    rows = {}
    for line in read(name, "out").splitlines():
        cells = [c.strip('"') for c in line.strip().split('","')]
        if len(cells) >= 7 and cells[0] in ("SET", "GET"):
            rows[cells[0]] = {"rps": float(cells[1]), "p50_ms": float(cells[4]), "p99_ms": float(cells[6])}
    return rows


def memcached_rows(name):
    return {r["test"]: r for r in rdmx(name)}


KV_GATEWAYS = [("tcp", "rdmx gateway, 2 nodes over tcp://"),
               ("rdma", "rdmx gateway, 2 nodes over rdma:// (soft RoCE)")]
KV_REDIS = "redis-server 7"


def kv_runs(stem, p):
    """The redis-benchmark rounds `stem`_P`p`_r1..3 that ran (parsed)."""
    return [r for r in (redis_csv(f"{stem}_P{p}_r{i}") for i in (1, 2, 3)) if r]


def kv_med(runs, test, key):
    """(median, spread %) of one redis-benchmark figure over rounds."""
    return med([r.get(test, {}).get(key) for r in runs])


# Rounds of each gateway and of redis-server interleaved with it (the same
# machine conditions), and memcached's single run.
kv_gw = {(scheme, p): kv_runs(f"kv_gw_{scheme}", p) for scheme, _ in KV_GATEWAYS for p in (1, 16)}
kv_red = {(scheme, p): kv_runs(f"kv_redis_{scheme}", p) for scheme, _ in KV_GATEWAYS for p in (1, 16)}
kv_mc = {p: memcached_rows(f"kv_memcached_P{p}") for p in (1, 16)}
if any(kv_gw.values()) or any(kv_red.values()):
    w("## KV cache: Redis clients against the rdmx gateway, redis-server and memcached\n")
    w("50 connections, 100-byte values, keys drawn from 100,000, SET then GET, P requests "
      "pipelined per connection. The gateway adds a hop (client → gateway → node); a GET is "
      "one one-sided read when the gateway remembers the key's item, else two (bucket, item). "
      "All processes share this VM's two cores. redis-benchmark's own CPU counts against "
      "every system alike.\n")
    w("Each gateway's runs interleave with redis-server's (gateway P1, redis P1, gateway P16, "
      "redis P16, three rounds): the figures are medians over the rounds, spread = (max − min) "
      "/ median of GET ops/s; redis-server has a row per interleave. memcached runs once.\n")
    w(f"Commands: `{cmd('kv_gw_tcp_P1_r1')}` (gateway; likewise `-P 16`, and for rdma:// nodes), "
      f"`{cmd('kv_redis_tcp_P1_r1')}`, `{cmd('kv_memcached_P1')}`.\n")
    servers = read("kv_servers", "cmds")
    if servers:
        w("The rdmx nodes and gateway (tcp:// run, then rdma://), each its own process:\n")
        w("```\n" + servers.strip() + "\n```\n")
    w("| system | P | rounds | SET ops/s | SET p50 ms | SET p99 ms | GET ops/s | GET spread | GET p50 ms | GET p99 ms |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def kv_row(label, p, runs):
        cells = [f(kv_med(runs, t, k)[0], d) for t in ("SET", "GET")
                 for k, d in (("rps", 0), ("p50_ms", 3), ("p99_ms", 3))]
        spread = kv_med(runs, "GET", "rps")[1] if len(runs) > 1 else None
        w(f"| {label} | {p} | {len(runs)} | {' | '.join(cells[:3])} | {cells[3]} | "
          f"{'—' if spread is None else f(spread, 0) + '%'} | {' | '.join(cells[4:])} |")

    for scheme, label in KV_GATEWAYS:
        for p in (1, 16):
            kv_row(label, p, kv_gw[(scheme, p)])
        for p in (1, 16):
            kv_row(f"{KV_REDIS}, between the {scheme}:// gateway's rounds", p, kv_red[(scheme, p)])
    for p in (1, 16):
        kv_row("memcached (text protocol, memcached_load)", p, [kv_mc[p]] if kv_mc[p] else [])
    w("")

    benches = {}
    for scheme in ("tcp", "rdma"):
        for value in (100, 4096, 65536):
            for mix in (95, 100):
                for path in ("one-sided", "rpc"):
                    rows = rdmx(f"kv_bench_{scheme}_{value}_{mix}_{path}")
                    benches[(scheme, value, mix, path)] = rows[0] if rows else None
    if any(benches.values()):
        w("### rdmx kv bench: one-sided GET against RPC GET\n")
        w("The native client, 32 operations in flight, keys by Zipf 0.99 over 1 M keys (the "
          "hottest loaded first, as many as fit 60% of the nodes' memory), 95/5 GET/SET "
          "(YCSB-B) or 100% GET, measured after an unmeasured warm-up of the same mix (each row "
          "is a new client process: the warm-up gives it a running client's connections and "
          "pointer cache). Node CPU is both nodes' process CPU seconds over the run "
          "per million GETs. Over TCP and soft RoCE the one-sided reads are still served by "
          "software in the node process (a NIC would serve them without it).\n")
        w(f"Command: `{cmd('kv_bench_tcp_100_95_one-sided')}` (likewise for each row).\n")
        w("READs per GET counts the one-sided path's index and item reads (1: the client "
          "knew where the item was, from an earlier GET or from its own SET; 2: a first look).\n")
        w("| nodes | value | GET % | path | ops/s | GET p50 µs | GET p99 µs | hit ratio | node CPU s / M GETs | retries | READs per GET |")
        w("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for (scheme, value, mix, path), r in benches.items():
            if r:
                reads = f(r['reads_per_get'], 2) if 'reads_per_get' in r and path == 'one-sided' else "–"
                w(f"| {scheme} | {value} | {mix} | {path} | {f(r['ops_per_s'], 0)} | {f(r['get_p50_us'], 1)} | "
                  f"{f(r['get_p99_us'], 1)} | {f(r['hit_ratio'], 3)} | {f(r['node_cpu_s_per_m_gets'], 2)} | {r['retries']} | {reads} |")
        w("")

    # The target row, three interleaved rounds per path: medians.
    rounds = {}
    for scheme in ("tcp", "rdma"):
        for path in ("one-sided", "rpc"):
            rs = [rdmx(f"kv_bench_{scheme}_100_100_{path}_r{i}") for i in (1, 2, 3)]
            rs = [r[0] for r in rs if r]
            if rs:
                rounds[(scheme, path)] = (med([r["ops_per_s"] for r in rs]),
                                          med([r["node_cpu_s_per_m_gets"] for r in rs]), len(rs))
    if rounds:
        w("### One-sided against RPC GET, 100 B, 100% GET, rounds back to back\n")
        w(f"Command: `{cmd('kv_bench_tcp_100_100_one-sided_r1')}` (and `--path rpc`), the two paths "
          "interleaved, three rounds each. Median over the rounds; spread = (max − min) / median.\n")
        w("| nodes | path | rounds | ops/s | spread | node CPU s / M GETs | spread |")
        w("|---|---|---:|---:|---:|---:|---:|")
        for (scheme, path), ((ops, ops_sp), (cpu, cpu_sp), n) in rounds.items():
            w(f"| {scheme} | {path} | {n} | {f(ops, 0)} | {f(ops_sp, 0)}% | {f(cpu)} | {f(cpu_sp, 0)}% |")
        w("")

    w("## Targets (issue 11), checked by the script\n")
    w("| target | measured | met |")
    w("|---|---|---|")
    for p in (1, 16):
        for scheme, label in KV_GATEWAYS:
            g, g_sp = kv_med(kv_gw[(scheme, p)], "GET", "rps")
            r, r_sp = kv_med(kv_red[(scheme, p)], "GET", "rps")
            if g and r:
                n = min(len(kv_gw[(scheme, p)]), len(kv_red[(scheme, p)]))
                rounds_ = f"medians of {n} interleaved rounds" if n > 1 else "one round"
                target(f"{label}: GET ≥ redis-server GET at P{p} ({rounds_})",
                       f"{f(g / r)} × ({f(g, 0)} ±{f(g_sp, 0)}% vs {f(r, 0)} ±{f(r_sp, 0)}% ops/s)", g >= r)
    for scheme in ("tcp", "rdma"):
        a, b = rounds.get((scheme, "one-sided")), rounds.get((scheme, "rpc"))
        if a and b and a[0][0] and b[0][0]:
            x = a[0][0] / b[0][0]
            target(f"{scheme}: one-sided GET ≥ 1.5 × RPC GET throughput (100 B, 100% GET, medians of {min(a[2], b[2])})",
                   f"{fx(x, 1.5)} × ({f(a[0][0], 0)} ±{f(a[0][1], 0)}% vs {f(b[0][0], 0)} ±{f(b[0][1], 0)}% ops/s)", x >= 1.5)
            target(f"{scheme}: one-sided GET uses less node CPU per GET than RPC (medians)",
                   f"{f(a[1][0])} vs {f(b[1][0])} s per M GETs", a[1][0] < b[1][0])
    w("")

# --- Block storage (rdmx-block) ---------------------------------------------
def fio_point(name):
    t = read(name, "out")
    if not t:
        return None
    try:
        j = json.loads(t[t.index("{"):])["jobs"][0]
    except (ValueError, KeyError, IndexError):
        return None
    side = j["read"] if j["read"]["io_bytes"] > 0 else j["write"]
    pct = side.get("clat_ns", {}).get("percentile", {})
    return {"iops": side["iops"], "mbs": side["bw_bytes"] / 1e6,
            "p50": pct.get("50.000000", 0) / 1000.0}


def native_point(name):
    r = rdmx(name)
    return r[0] if r else None


BLOCK_JOBS = [("rr4k_qd1", "4k randread qd1"), ("rr4k_qd32", "4k randread qd32"),
              ("rw4k_qd1", "4k randwrite qd1"), ("rw4k_qd32", "4k randwrite qd32"),
              ("seq128k_qd32", "128k read qd32")]
BLOCK_SERVERS = [("rdmx_tcp", "rdmx NBD, NVMe over rdmx tcp://"), ("rdmx_rdma", "rdmx NBD, NVMe over rdmx rdma://"),
                 ("rdmx_tcp_poll", "rdmx NBD, NVMe over rdmx tcp://, busy-poll 100 µs"),
                 ("qemu_nbd", "qemu-nbd (tmpfs file)"), ("nbdkit", "nbdkit memory")]
RDMX_BLOCK = [s for s, _ in BLOCK_SERVERS if s.startswith("rdmx_")]
reps = sorted({int(n.rsplit("_r", 1)[1].split(".")[0]) for n in os.listdir(OUT) if n.startswith("block_fio_") and n.endswith(".out")})
if reps:
    w("## Block storage: fio's nbd engine against rdmx, qemu-nbd and nbdkit\n")
    w(f"1 GiB of RAM behind each server, 127.0.0.1; {len(reps)} interleaved round(s); "
      "median IOPS (spread = (max − min) / median over the rounds) and median of the per-round p50 latencies.\n")
    w("```\n" + (cmd(f"block_fio_rdmx_rdma_rr4k_qd32_r{reps[0]}") or "") + "\n```\n")
    servers = read("block_servers", "cmds")
    if servers:
        w("The rdmx target and NBD export of each rdmx column (each its own process):\n")
        w("```")
        for line in servers.strip().splitlines():
            _, scmd, ncmd = line.split("|")
            w(scmd.strip())
            w(ncmd.strip())
        w("```\n")
    w("| workload | " + " | ".join(label for _, label in BLOCK_SERVERS) + " |")
    w("|---|" + "---:|" * len(BLOCK_SERVERS))
    block = {}
    for job, jlabel in BLOCK_JOBS:
        cells = []
        for server, _ in BLOCK_SERVERS:
            pts = [fio_point(f"block_fio_{server}_{job}_r{r}") for r in reps]
            iops, spread = med([p["iops"] for p in pts if p])
            p50, _ = med([p["p50"] for p in pts if p])
            block[(server, job)] = (iops, p50)
            cells.append("–" if iops is None else f"{f(iops, 0)} IOPS ±{f(spread, 0)}%, p50 {f(p50, 1)} µs")
        w(f"| {jlabel} | " + " | ".join(cells) + " |")
    w("")
    nreps = sorted({int(n.rsplit("_r", 1)[1].split(".")[0]) for n in os.listdir(OUT) if n.startswith("block_native_") and n.endswith(".out")})
    if nreps:
        w("### The native Initiator (`rdmx block bench`), NVMe over rdmx\n")
        w("```\n" + (cmd(f"block_native_rdma_rr4k_qd32_r{nreps[0]}") or "") + "\n```\n")
        w("| workload | tcp:// | rdma:// (soft RoCE) |")
        w("|---|---:|---:|")
        for job, jlabel in BLOCK_JOBS:
            cells = []
            for scheme in ("tcp", "rdma"):
                pts = [native_point(f"block_native_{scheme}_{job}_r{r}") for r in nreps]
                if not any(pts):
                    cells.append("–")
                    continue
                iops, spread = med([p["iops"] for p in pts if p])
                mbs, _ = med([p["mb_per_s"] for p in pts if p])
                p50, _ = med([p["p50_us"] for p in pts if p])
                cells.append(f"{f(iops, 0)} IOPS ±{f(spread, 0)}%, {f(mbs, 1)} MB/s, p50 {f(p50, 1)} µs")
            if any(c != "–" for c in cells):
                w(f"| {jlabel} | " + " | ".join(cells) + " |")
        w("")
    w("## Targets (issue 13), checked by the script\n")
    w("| target | measured | met |")
    w("|---|---|---|")
    q32, k32 = block.get(("qemu_nbd", "rr4k_qd32")), block.get(("nbdkit", "rr4k_qd32"))
    q1 = block.get(("qemu_nbd", "rr4k_qd1"))
    for server, label in BLOCK_SERVERS[:len(RDMX_BLOCK)]:
        r32, r1 = block.get((server, "rr4k_qd32")), block.get((server, "rr4k_qd1"))
        if r32 and q32 and r32[0] and q32[0]:
            target(f"{label}: 4k randread qd32 IOPS ≥ 1.5 × qemu-nbd",
                   f"{f(r32[0] / q32[0])} × ({f(r32[0], 0)} vs {f(q32[0], 0)})", r32[0] >= 1.5 * q32[0])
        if r32 and k32 and r32[0] and k32[0]:
            target(f"{label}: 4k randread qd32 IOPS ≥ nbdkit memory",
                   f"{f(r32[0] / k32[0])} × ({f(r32[0], 0)} vs {f(k32[0], 0)})", r32[0] >= k32[0])
        if r1 and q1 and r1[1] and q1[1]:
            target(f"{label}: 4k randread qd1 p50 ≤ qemu-nbd's",
                   f"{f(r1[1], 1)} vs {f(q1[1], 1)} µs", r1[1] <= q1[1])
    w("")

print("\n".join(o))
