"""The GPU check: everything that needs a CUDA machine, in one command, for the rare session that
is lent one (`docs/results.md`, section 6; issues 11 and 12).

Each step is a subprocess that writes its own `benchmarks/results/gpu_*.json`; this script writes
`gpu_check.json` with each step's exit code, seconds and output tail. Steps, in order:

| step | what | result file |
|---|---|---|
| `tests` | `pytest -m cuda` (tests/gpu/test_cuda.py: the LoRDO step on CUDA equals the CPU step for every option, bf16 autocast training lowers the loss, a worker + aggregator round on CUDA matches the CPU) | `gpu_tests.json` |
| `step16m`, `step125m` | benchmarks/step_cost.py on the GPU: `optimizer.step()` and the whole step, batched LoRDO and the reference against fused AdamW; projection refreshes (svd / rsvd / dct) on 720m shapes, per matrix and as the aggregator's batched whole-model refit | `gpu_step_cost_16m.json`, `gpu_step_cost_125m.json` |
| `memory` | benchmarks/memory.py --device cuda: a worker's peak device memory (and RSS) for one round at 125m, 360m, 720m: AdamW, LoRDO with EF fp32 / bf16 / none (GaLore's state) / compressed | `gpu_memory.json` |
| `round125m` | benchmarks/framework_overhead.py, 125m preset: the reference trainer against a deployment with the server and two node workers on this one GPU (issue 11: a round split into transfer, training, aggregation) | `gpu_framework_overhead_125m.json` |
| `dataplane` | benchmarks/dataplane_throughput.py on this machine's 16 cores (the data plane against bare gRPC when the nodes do not share 2 cores) | `gpu_machine_dataplane_throughput.json` |
| `overhead16m` | benchmarks/framework_overhead.py, 16m, reference / two at once / node workers, on 16 cores | `gpu_machine_framework_overhead_16m.json` |
| `ranks` | benchmarks/node_ranks.py --overhead-only: a one-rank node's local steps through DDP and through FSDP2 (NCCL) against the bare model, 125m (issue 17: ≤ 5%) | `gpu_node_ranks.json` |
| `corpora` | benchmarks/corpora_quality.py --jobs 14: every method on three corpora at 16 and 64 rounds, each method's best of five trials (issue 31; hours on 2 CPU cores); the tuning is written first, so a call cut short keeps it | `gpu_corpora_quality.json`, `gpu_corpora_runs.tar.gz` |

The 2-client 125m simulation round the GPU-readiness issue asks for is the `round125m` step's
reference trainer (two workers and the aggregator in one process on the GPU) beside the
deployment.

On a lent GPU machine: it has torch but not Flower or Hydra, and no network, so run
`scripts/device_wheels.sh` here once and carry `.whl`. One device command is at most 10 minutes and
a session's device time was 15 minutes in all, so give the call `--budget-s` (a step's timeout is cut
to what is left; `gpu_check.json` is rewritten after every step, so a call cut off still reports).
On an H200 (2026-11-26): tests 13-20 s, step125m 53 s, step16m 42 s, memory 376 s, ranks 27 s;
corpora's tuning (60 runs of 512 steps, 14 at once) 444 s, and the 16-round runs of one seed 220 s, the
runs taking turns on the GPU. The corpora step now starts the CUDA MPS daemon, so the runs share the GPU
at once (2026-11-27, H200): the 64-round runs of one seed (12: four methods on three corpora) 212 s, a
seed's 16-round table 71 s. The step starts from the runs earlier sessions finished
(`gpu_corpora_runs.tar.gz` in benchmarks/results/, the cache) and writes them back to --out-dir with
its own added, a call cut short included: copy that file back, commit it, and split what is left with
`--corpora-args` (e.g. '--part table --seeds 0 --methods lowrank_ddp,lordo_global,lordo_local';
docs/results.md, section 17). At most 8 files come back from a call: give each call its own `--out-dir` (the PNGs count).
What the corpora step has left (2026-11-27): the sixth trial of each method (`--part tune --horizons 16`:
15 runs, the other 75 cached), then the late rounds on every corpus (`--part late --horizons 64`: 6 runs,
the references cached; and `--horizons 16`), then the 64-round table at the tuning's new winners, and
what four workers cost on every corpus (`--part workers --horizons 16`: 7 runs a corpus; the CPU ran prose).
Since (2026-11-29): the 64-round table at today's lrs needs code seed 1 only (`--part table --best ...
--corpora code --seeds 1 --horizons 64`, the CPU ran the other five pairs), and the early-round gap at
the bytes of K = 32 (`--part exchanges --horizons 16 --corpora code --methods lordo_global`: LoRDO-Global's K = 8
and 16 with int8 and K = 8 in fp32; the CPU ran prose and verse, and LoRDO-Local's probe everywhere). Since
(2026-11-29, later): the CPU ran LoRDO-Local with K = 8 and int8 at 64 rounds on every corpus and seed
(results.md section 17, parts seven and eight) and, later, prose seed 0's references with curves and code seed 1's
whole table (part nine): the 64-round table at today's lrs is complete on the CPU. Since (2026-11-30): a corpus
that 64 rounds read less than once, 30 MB of Python code made from the machine's own standard library (section 17,
part ten; the CPU ran seed 0): its second seed at both horizons on the GPU is
`python3 scripts/make_stdlib_corpus.py /tmp/stdlib_large.txt` and then `--only corpora --corpora-args '--part table
--best lowrank_ddp=ef0.9-lr0.5x,lordo_global=ef0.9-lr0.5x,lordo_local=ef1-switch-lr0.5x,diloco=average1-lr0.5x
--methods lowrank_ddp,diloco,lordo_global,lordo_local --corpus code-large=/tmp/stdlib_large.txt --corpora code-large
--seeds 1'` (another Python gives other text: the result records its sha256). Since (2026-12-01): the CPU ran
code-large's second seed at 64 rounds with spread validation windows, and LoRDO-Local's `k8-int8-b0.9` probe (β1 0.9
after its switch; section 17, part twelve). Since (2026-12-02): the CPU ran that probe on the shipped corpora's
two seeds at 16 rounds and on prose seed 0 at 64 (part thirteen). Since (2026-12-02, later): verse at 64 rounds, both seeds (part fourteen). Next on the GPU: the rest of 64 rounds,
`--only corpora --corpora-args '--part exchanges --methods lordo_local --probes k8-int8,k8-int8-b0.9 --horizons 64'`.
Since (2026-12-04): LoRDO-Global's `ramp2x256-int8` on every corpus and seed at both horizons (`--part exchanges
--methods lordo_global --probes ramp2x256-int8 --seeds 0,1 --jobs 18`: the 18 runs of 64 rounds at once under MPS in
368 s, the ramp's 340-350 s a run; section 17, part twenty). A call cut short leaves its runs' checkpoints in
/tmp/gpu_check_corpora, and the next call on the same warm machine continues them (the 16-round ramp runs: cut at
144 s, then done in 72 s); a fresh machine starts them again.

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH && python3 benchmarks/gpu_check.py --only tests,step16m,step125m
    ... --only round125m      ... --only dataplane,overhead16m      ... --only ranks      ... --only corpora

    python benchmarks/gpu_check.py --quick --device cpu --only tests,step16m   # the orchestration, on a CPU
Copy the result files back from $OUT (`--out-dir $OUT`) into benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = ("tests", "step16m", "step125m", "memory", "round125m", "dataplane", "overhead16m", "ranks", "corpora")
CORPORA_RUNS = RESULTS / "gpu_corpora_runs.tar.gz"
"""Every corpora run a GPU session finished (each run's result.json): the `corpora` step starts from
it as corpora_quality's cache and writes it back with the new runs added, so each session trains
only what is missing (docs/results.md, section 17). Each run records the commit it trained at and its host
(CPU, torch, GPU); one from another host trains anew (`unpack_corpora_runs`)."""
CORPORA_WORK = Path(tempfile.gettempdir()) / "gpu_check_corpora"


def commands(step: str, device: str, quick: bool, out_dir: Path, corpora_args: tuple[str, ...] = ()
             ) -> tuple[list[str], Path, float]:
    """(argv, result file, timeout seconds) of one step."""
    py, bench = sys.executable, ROOT / "benchmarks"
    q = ["--quick"] if quick else []
    if step == "tests":
        return [py, "-m", "pytest", "-q", "-m", "cuda", "-rs", "-p", "no:cacheprovider", "tests/gpu/test_cuda.py"], \
            out_dir / "gpu_tests.json", 540
    if step in ("step16m", "step125m"):
        preset = "tiny" if quick else step.removeprefix("step")
        out = out_dir / f"gpu_step_cost_{step.removeprefix('step')}.json"
        return [py, str(bench / "step_cost.py"), *q, "--device", device, "--preset", preset, "--out", str(out)], out, 540
    if step == "memory":
        out = out_dir / "gpu_memory.json"
        return [py, str(bench / "memory.py"), *q, "--device", device, "--peak-presets",
                "tiny" if quick else "125m,360m,720m", "--out", str(out)], out, 560
    if step == "round125m":
        out = out_dir / "gpu_framework_overhead_125m.json"
        return [py, str(bench / "framework_overhead.py"), *q, "--preset", "tiny" if quick else "125m", "--rounds", "3",
                "--modes", "reference,node-workers", "--out", str(out)], out, 560
    if step == "dataplane":
        out = out_dir / "gpu_machine_dataplane_throughput.json"
        return [py, str(bench / "dataplane_throughput.py"), *q, "--out", str(out)], out, 560
    if step == "overhead16m":
        out = out_dir / "gpu_machine_framework_overhead_16m.json"
        return [py, str(bench / "framework_overhead.py"), *q, "--preset", "tiny" if quick else "16m",
                "--modes", "reference,reference-concurrent,node-workers", "--out", str(out)], out, 560
    if step == "ranks":
        out = out_dir / "gpu_node_ranks.json"
        return [py, str(bench / "node_ranks.py"), *q, "--overhead-only", "--device", device,
                "--preset", "tiny" if quick else "125m", "--out", str(out)], out, 560
    if step == "corpora":
        out = out_dir / "gpu_corpora_quality.json"
        work = ["--work", str(CORPORA_WORK)] if not quick else []
        return [py, str(bench / "corpora_quality.py"), *q, "--device", device, "--jobs", "2" if quick else "14",
                *work, *corpora_args, "--out", str(out)], out, 580
    raise ValueError(f"unknown step {step!r}: expected one of {STEPS}")


def unpack_corpora_runs(archive: Path, work: Path, host: dict | None = None) -> int:
    """Extract the finished runs (`CORPORA_RUNS`) into corpora_quality's --work folder; how many. With `host`
    (what a run trained here records: benchmarks/quality.py `execute`), a run that records another host is left
    out, printed, and trains anew: its figures would not be this machine's (runs from before the record stay)."""
    work.mkdir(parents=True, exist_ok=True)
    if not archive.is_file():
        return 0
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith("/result.json")]
        tar.extractall(work, members=members, filter="data")  # plain files inside `work` only
    other = [m.name for m in members if host is not None and json.loads((work / m.name).read_text()).get("host", host) != host]
    for name in other:
        (work / name).unlink()
    if other:
        print(f"[gpu_check] corpora: {len(other)} cached runs trained on another host than {host} train anew, e.g. "
              f"{other[0]}", flush=True)
    return len(members) - len(other)


def pack_corpora_runs(work: Path, archive: Path) -> int:
    """Every finished run in `work` (its result.json) into `archive`; how many."""
    done = sorted(work.glob("*/result.json"))
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for path in done:
            tar.add(path, arcname=str(path.relative_to(work)))
    return len(done)


def start_mps(env: dict[str, str]) -> dict[str, str]:
    """Start the CUDA MPS daemon, so that corpora's many one-thread runs share the GPU at once instead
    of taking turns (2026-11-27, H200: 4x the runs per second, docs/results.md section 17); the env of
    its clients, or `env` unchanged where the daemon is missing or a client cannot reach it."""
    import shutil

    if shutil.which("nvidia-cuda-mps-control") is None:
        return env
    mps = dict(env, CUDA_MPS_PIPE_DIRECTORY=str(Path(tempfile.gettempdir()) / "mps"),
               CUDA_MPS_LOG_DIRECTORY=str(Path(tempfile.gettempdir()) / "mps-log"))
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        Path(mps[key]).mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=mps, timeout=20, check=True)
        subprocess.run([sys.executable, "-c", "import torch; torch.ones(1, device='cuda').add_(1).item()"],
                       env=mps, timeout=60, check=True)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"[gpu_check] MPS unavailable ({exc}): the runs take turns on the GPU", flush=True)
        stop_mps(mps)
        return env
    print("[gpu_check] MPS daemon started", flush=True)
    return mps


def stop_mps(mps: dict[str, str]) -> None:
    try:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=mps, timeout=10)
    except (subprocess.SubprocessError, OSError):
        pass


def pytest_counts(output: str) -> dict[str, int]:
    """passed / failed / skipped / error counts from pytest's summary line."""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output)}


def run_host(device: str) -> dict:
    """The host a corpora run trained here records (benchmarks/quality.py `execute`)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import host_of, machine_info
    from benchmarks.quality import torch_device_name
    from lordo_fed.device import pick_device

    return {**host_of(machine_info()), "device": torch_device_name(pick_device(device))}


def machine() -> dict:
    """`benchmarks.common.machine_info` with the CUDA version and the GPU."""
    import torch

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import machine_info

    info = {**machine_info(), "cuda": torch.version.cuda, "gpu": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "multiprocessors": props.multi_processor_count}
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps (default all: {','.join(STEPS)})")
    parser.add_argument("--device", default="cuda", help="where the step benchmarks run (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny presets and the benchmarks' --quick (a structure check)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the gpu_*.json files go")
    parser.add_argument("--corpora-args", default="",
                        help="more arguments of corpora_quality.py in the `corpora` step, e.g. '--part table --seeds 0 "
                        "--methods lowrank_ddp,lordo_global,lordo_local' (a 64-round table takes more than one call)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for all steps together: each step's timeout is cut to what is left, and a step "
                             "with under 30 s left is skipped (a lent machine's call is at most 10 minutes)")
    args = parser.parse_args(argv)
    steps = [s for s in args.only.split(",") if s]
    for s in steps:
        if s not in STEPS:
            parser.error(f"--only {s!r}: expected steps among {STEPS}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT)])
    summary = {"benchmark": "gpu_check", "quick": args.quick, "device": args.device, "machine": machine(), "steps": {}}
    status = 0
    path = args.out_dir / "gpu_check.json"
    deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s
    for step in steps:
        argv_, out, timeout = commands(step, args.device, args.quick, args.out_dir, tuple(args.corpora_args.split()))
        step_env = env
        if step == "corpora" and not args.quick:
            print(f"[gpu_check] corpora: {unpack_corpora_runs(CORPORA_RUNS, CORPORA_WORK, run_host(args.device))} "
                  f"finished runs from "
                  f"{CORPORA_RUNS.name}", flush=True)
            step_env = start_mps(env) if args.device == "cuda" else env
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left < 30:
                summary["steps"][step] = {"rc": None, "skipped": f"budget: {left:.0f} s left of {args.budget_s:.0f}"}
                print(f"[gpu_check] {step}: skipped, {left:.0f} s of the budget left", flush=True)
                continue
            timeout = min(timeout, left)
        print(f"[gpu_check] {step}: {' '.join(argv_)}", flush=True)
        started = time.perf_counter()
        # its own process group: a step cut off at its timeout takes its children with it (corpora's
        # process pool would otherwise train on, beside the next step)
        proc = subprocess.Popen(argv_, cwd=ROOT, env=step_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            rc, output = proc.returncode, stdout + stderr
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            rc, output = 124, f"timed out after {timeout:.0f} s\n{stdout}{stderr}"
        entry = {"rc": rc, "seconds": round(time.perf_counter() - started, 1), "result": out.name,
                 "output_tail": output[-3000:]}
        if step == "tests":
            entry["counts"] = pytest_counts(output.splitlines()[-1] if output.strip() else "")
            out.write_text(json.dumps({"benchmark": "gpu_tests", "machine": summary["machine"], **entry}, indent=1) + "\n")
        entry["result_written"] = out.is_file()
        if step == "corpora" and not args.quick:  # also what a call cut short finished
            entry["finished_runs"] = pack_corpora_runs(CORPORA_WORK, args.out_dir / CORPORA_RUNS.name)
        if step_env is not env:
            stop_mps(step_env)
            entry["mps"] = True
        summary["steps"][step] = entry
        status = status or rc
        print(f"[gpu_check] {step}: rc {rc}, {entry['seconds']} s, {out.name} written: {entry['result_written']}",
              flush=True)
        # Written after every step, so a call cut off at its limit still returns the steps it finished.
        path.write_text(json.dumps(summary, indent=1) + "\n")
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"[gpu_check] wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
