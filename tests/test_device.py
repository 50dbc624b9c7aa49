"""CPU ranks keep freed tensor memory in the heap (device.keep_freed_memory): glibc would
otherwise return it to the kernel and every step would page-fault it in again. And
`run.cpu_affinity=cores` pins every thread of a rank to its share of the cores
(device.pin_cpu_cores)."""

import subprocess
import sys

SCRIPT = """
import os, resource, torch
from shardwise.distributed.device import keep_freed_memory

def faults():
    def step():  # 64 x 1 MB of activations, freed together at the end of a step
        xs = [torch.ones(1 << 18) for _ in range(64)]
        del xs
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

os.environ["SHARDWISE_MALLOC"] = "default"  # the opt-out changes nothing
print(keep_freed_memory(), faults())
del os.environ["SHARDWISE_MALLOC"]
print(keep_freed_memory(), faults())
"""


def test_freed_memory_is_kept_for_the_next_step():
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no MALLOC_* of the caller's
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    (opt_out, default), (kept, ours) = (line.split() for line in out.stdout.splitlines())
    assert opt_out == "False" and kept == "True"
    # glibc's default: the 64 MB go back to the kernel every step (measured: ~33k faults in
    # 5 steps); kept in the heap they fault in once, before the counted steps
    assert int(default) > 5_000, default
    assert int(ours) < int(default) / 20, (ours, default)


PIN_SCRIPT = """
import json, os, threading
from shardwise.distributed.device import pin_cpu_cores

def affinities():
    tids = os.listdir("/proc/self/task")
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids})

def in_new_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(sorted(os.sched_getaffinity(0))))
    t.start(); t.join()
    return out[0]

stop = threading.Event()
early = threading.Thread(target=stop.wait)  # stands for gloo's threads, started before pinning
early.start()
allowed = sorted(os.sched_getaffinity(0))
got = {"allowed": allowed, "none_first": pin_cpu_cores("none", 0, 2), "ranks": []}
for rank in range(3):
    cores = pin_cpu_cores("cores", rank, 3)
    got["ranks"].append([cores, affinities(), in_new_thread()])
got["none_after"] = [pin_cpu_cores("none", 0, 3), affinities()]
stop.set(); early.join()
print(json.dumps(got))
"""


def test_cpu_affinity_pins_every_thread_of_a_rank_to_its_share():
    import json

    out = subprocess.run(
        [sys.executable, "-c", PIN_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    allowed = got["allowed"]
    assert got["none_first"] is None  # never pinned: nothing touched
    k = max(1, len(allowed) // 3)
    for rank, (cores, threads, new_thread) in enumerate(got["ranks"]):
        first = (rank * k) % len(allowed)
        assert cores == allowed[first : first + k], (rank, cores, allowed)
        # every thread (the one started before pinning too) and a thread started later
        assert threads == [cores], (rank, threads)
        assert new_thread == cores
    none, threads = got["none_after"]
    assert none is None and threads == [allowed]  # "none" undoes this process's pinning


def test_run_cpu_affinity_pins_each_rank_of_a_job_and_none_undoes_it():
    import os

    from shardwise.launchers.harness import run_world
    from support.compare import SMALL

    def case(mode: str) -> dict:
        overrides = [*SMALL, f"--run.cpu_affinity={mode}"]
        return {"overrides": overrides, "peer": "support.hooks:thread_affinities"}

    allowed = sorted(os.sched_getaffinity(0))
    k = max(1, len(allowed) // 2)
    pinned, unpinned = run_world(2, [case("cores"), case("none")])  # the same two processes
    for rank, got in enumerate(pinned):
        first = (rank * k) % len(allowed)
        assert got["affinities"] == [allowed[first : first + k]], (rank, got)
    assert [got["affinities"] for got in unpinned] == [[allowed], [allowed]]
