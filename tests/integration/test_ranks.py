"""A node of several ranks (lordo_fed.node.ranks): two gloo processes on this CPU train as one
worker whose batch is both ranks' rows together, with each intra-node wrapper (DDP: the state
replicated; FSDP2: θ, gradients and optimizer state sharded across the ranks).

The oracle is a one-process worker with the doubled batch whose gradient is the mean of its two
halves' gradients, the arithmetic of the ranks' all-reduce (`in_row_blocks`): after two rounds (so
LoRDO-Global's refitted basis and the moments' rotation are in play) its Δ, its moments, its θ and
its loss must equal the two-rank node's, for LoRDO-Global, LoRDO-Local and DiLoCo: under DDP bit
for bit (measured), under FSDP2 to the fp32 rounding of its sharded step. Model and data as
tests/unit/test_worker.py (tiny model, random tokens).
"""

from __future__ import annotations

import os
import time
from typing import NoReturn

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lordo_fed.device import autocast
from lordo_fed.model import lm_loss
from lordo_fed.rounds.methods import lowrank_ranks, make_aggregator, make_worker, resolve_method
from lordo_fed.rounds.relay import for_worker
from lordo_fed.rounds.worker import Worker
from lordo_fed.trainer.run import as_received
from lordo_fed.wire.compress import decoded
from lordo_fed.wire.decode import decode_global_state
from lordo_fed.wire.encode import encode_global_state
from lordo_fed.wire.messages import GlobalState
from lordo_fed.wire.payload import resolve_payload
from lordo_fed.model import DEFAULT_LOWRANK_PATTERN, lowrank_parameter_names
from lordo_fed.node.ranks import WRAPPERS, LocalRanks, exit_rank
from lordo_fed.optim.sharded import gather, local
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.rounds.config import RoundConfig
from tests.unit.test_worker import BATCH, K, RANK, SEQ, TOTAL_STEPS, shard, snapshot, tiny_model

METHODS = ("lordo_global", "lordo_local", "diloco")
ROUNDS = 2
RELAYED = ("diloco", "lordo_global")
"""The methods run with the relay (`topk2bit-relay`): issue 30's best point, and LoRDO-Global."""


def in_row_blocks(worker: Worker, parts: int) -> Worker:
    """`worker`, its every gradient computed as the mean of the gradients of its batch's `parts` row
    blocks, accumulated block after block: in one process, the arithmetic of a node of `parts` ranks
    (rank i's rows, averaged by the all-reduce).

    One backward pass over the whole batch sums the same terms in another order, and LoRDO-Local's
    SVD refit of its first, nearly degenerate gradient amplifies that rounding: against the whole
    batch, the two halves' round-1 Δ differs by 5.2e-3 of its largest entry (measured in one
    process, no ranks at all), more than the 2e-3 `_close` allows."""
    if parts == 1:
        return worker

    def forward_backward(batch_index: int, scale: float = 1.0) -> torch.Tensor:
        x, y = worker.shard.batch(batch_index, worker.node_batch, worker.seq_len, seed=worker.data_seed)
        loss = torch.zeros(())
        for xb, yb in zip(x.chunk(parts), y.chunk(parts)):
            with autocast(worker.device):
                part = lm_loss(worker.forward_module, xb.to(worker.device), yb.to(worker.device))
            (part * scale / parts).backward()
            loss = loss + part.detach().float() / parts
        return loss
    worker.forward_backward = forward_backward
    return worker


def node_rounds(method: str, ranks: LocalRanks | None, batch: int, resume: bool = False, halves: int = 1,
                payload: str = "fp32", rounds: int = ROUNDS) -> dict:
    """`rounds` rounds (two) of one node (its worker and its own aggregator, as a one-node federation):
    every round's update and the final θ and optimizer moments, as whole host tensors, and the
    elements this rank holds of θ. With `resume`, the worker is rebuilt between the rounds from
    the state it saved (`flat_state`, the lead's copy on every rank), as a restarted node is. With
    `halves` (one process standing for a node of that many ranks), the gradients are taken in row
    blocks (`in_row_blocks`). With a relaying `payload` (topk2bit-relay) each state goes through the wire
    as the node gets it, its own reply left out (`relay.for_worker`), and after the last round each rank
    replays the server's θ from one more state (`theta_c`)."""
    torch.set_num_threads(1)
    s = resolve_method(method, InnerConfig(rank=RANK), RoundConfig(local_steps=K), OuterConfig(),
                       total_steps=rounds * K)
    model = tiny_model(0)
    lowrank = lowrank_parameter_names(model) if s.inner.name == "lordo" else []
    ranks_of = lowrank_ranks(model, DEFAULT_LOWRANK_PATTERN, RANK, s.inner.name)
    wire = resolve_payload(payload)
    relaying = wire.codecs is not None and wire.codecs.relay

    def sent(state: GlobalState) -> GlobalState:  # the state as this node gets it
        if not relaying:
            return snapshot(state)
        return decode_global_state(encode_global_state(for_worker(state, 0), "m"), "m", codecs=wire.codecs.down_specs())

    # the aggregator before the worker: FSDP2 shards the model it is given
    agg = make_aggregator(model, s, ranks_of, seed=0, payload=wire)
    worker = in_row_blocks(make_worker(0, model, s, shard(0), lowrank, TOTAL_STEPS, batch, SEQ, seed=0, payload=wire,
                                       ranks=ranks), halves)
    if agg.needs_gradient_init:
        agg.init_projections([worker.gradient(agg.gradient_request(), sorted(ranks_of))])
    updates, own_left_out = [], 0
    for r in range(rounds):
        if resume and r:
            saved = worker.flat_state()
            worker = in_row_blocks(make_worker(0, model, s, shard(0), lowrank, TOTAL_STEPS, batch, SEQ, seed=0,
                                               payload=wire, ranks=ranks), halves)
            worker.load_flat_state(*saved)
        state = sent(agg.global_state())
        own_left_out += state.relay_own == 0
        update = worker.train_round(state)
        updates.append({"delta": decoded(update.delta), "moments": decoded(update.moments), "tokens": update.tokens,
                        "loss": update.metrics["train_loss"],
                        "kept": None if worker.downlink.own is None else bytes(worker.downlink.own.numpy())})
        agg.aggregate([as_received(update)] if relaying else [update], relay={0: update} if relaying else None)
    moments = {f"{n}/{k}": gather(v.detach(), p).clone() for n, p in worker.params.items()
               for k, v in worker.optimizer.state[p].items() if k in ("exp_avg", "exp_avg_sq", "ef")}
    result = {"updates": updates, "theta": worker._host_params(), "state": moments,
              "held": sum(local(p).numel() for p in worker.params.values())}
    if relaying:  # the next round's start, replayed on this rank from its kept reply, and the server's θ
        theta_c = worker.downlink.theta(sent(agg.global_state()), worker.params)
        result.update(theta_c={n: t.clone() for n, t in theta_c.items()}, server_theta=dict(agg.params),
                      own_left_out=own_left_out)
    return result


def leave() -> NoReturn:
    """The end of a spawned rank whose results are written: once every rank is here (none closes
    its connections while another still waits in a collective with it), exit without the
    interpreter's finalization, under which gloo's threads, still running after
    destroy_process_group, can abort the process (SIGABRT, lordo_fed.node.ranks.exit_rank).
    A rank that raised does not get here: mp.spawn reports its exception."""
    dist.barrier()
    exit_rank(0)


def _rank_main(rank: int, world: int, rendezvous: str, out: str, wrapper: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    results = {m: node_rounds(m, LocalRanks(rank, world, wrapper), BATCH) for m in METHODS}
    results["resumed"] = node_rounds("lordo_global", LocalRanks(rank, world, wrapper), BATCH, resume=True)
    for method in RELAYED:
        for resume in (False, True):
            results[f"relay-{method}{'-resumed' * resume}"] = node_rounds(
                method, LocalRanks(rank, world, wrapper), BATCH, resume=resume, payload="topk2bit-relay", rounds=3)
    torch.save(results, f"{out}.{rank}")
    leave()


@pytest.fixture(scope="module", params=WRAPPERS)
def two_rank_node(request, tmp_path_factory):
    """(wrapper, both ranks' results of every method): one spawn of two gloo processes per wrapper."""
    tmp = tmp_path_factory.mktemp(f"ranks-{request.param}")
    mp.spawn(_rank_main, args=(2, str(tmp / "rendezvous"), str(tmp / "result"), request.param), nprocs=2, join=True)
    return request.param, [torch.load(tmp / f"result.{r}", weights_only=False) for r in range(2)]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal up to fp32 rounding as the Adam steps amplify it: a first step divides by √v, so an
    entry with a tiny gradient moves by ~lr whatever its last bits (measured against `in_row_blocks`:
    0 under DDP, at most 3.1e-4 of the tensor's largest entry under FSDP2, LoRDO-Local's round-1 Δ;
    another batch moves it by its whole size)."""
    assert a.shape == b.shape, what
    worst, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert worst <= 2e-3 * scale + 1e-9, f"{what}: max |a − b| = {worst:.3g}, max |b| = {scale:.3g}"


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_equal_one_process_with_both_batches(two_rank_node, method):
    wrapper, results = two_rank_node
    reference = node_rounds(method, None, 2 * BATCH, halves=2)
    lead, other = (r[method] for r in results)
    for r, (mine, ref) in enumerate(zip(lead["updates"], reference["updates"]), start=1):
        assert mine["tokens"] == ref["tokens"] == K * 2 * BATCH * SEQ
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert set(mine["delta"]) == set(ref["delta"]) and set(mine["moments"]) == set(ref["moments"])
        for n in ref["delta"]:
            _close(mine["delta"][n], ref["delta"][n], f"round {r} Δ {n}")
        for k in ref["moments"]:
            _close(mine["moments"][k], ref["moments"][k], f"round {r} {k}")
    for n in reference["theta"]:
        _close(lead["theta"][n], reference["theta"][n], f"θ {n}")
    for k in reference["state"]:
        _close(lead["state"][k], reference["state"][k], f"state {k}")
    # DDP: each rank holds θ whole; FSDP2: half of it each (a 2-D weight a chunk of rows or columns)
    whole = sum(t.numel() for t in reference["theta"].values())
    if wrapper == "ddp":
        assert lead["held"] == other["held"] == whole
    else:
        assert lead["held"] + other["held"] == whole and lead["held"] <= whole // 2 + 64, (lead["held"], whole)
    # the ranks hold the same node state (whole under DDP, gathered under FSDP2), and send none of it
    for n in lead["theta"]:
        assert torch.equal(lead["theta"][n], other["theta"][n]), n
    for k in lead["state"]:
        assert torch.equal(lead["state"][k], other["state"][k]), k
    # and the comparison can fail: one rank's batch alone is another run
    single = node_rounds(method, None, BATCH)["updates"][0]["delta"]
    first = reference["updates"][0]["delta"]
    assert max((single[n] - first[n]).abs().max().item() / first[n].abs().max().item() for n in first) > 0.1


def test_a_node_resumes_from_its_saved_state(two_rank_node):
    """Rebuilt between the rounds from the state it saved (the lead's copy, read by both ranks and
    cut to each one's chunk under FSDP2), the node trains round 2 as if it had not stopped."""
    _, results = two_rank_node
    for rank in results:
        straight, resumed = rank["lordo_global"], rank["resumed"]
        for a, b in zip(straight["updates"], resumed["updates"]):
            for n in a["delta"]:
                assert torch.equal(a["delta"][n], b["delta"][n]), n
        for k in straight["state"]:
            assert torch.equal(straight["state"][k], resumed["state"][k]), k


@pytest.mark.parametrize("method", RELAYED)
def test_every_rank_replays_the_relayed_round_from_its_own_kept_reply(two_rank_node, method):
    """The relay on a node of two ranks: every rank encodes the node's reply and keeps it (only the lead
    sends it), so each state, which leaves that reply out (`relay.for_worker`), is completed on every rank
    from its own copy. Both ranks keep the same reply bytes, replay the server's θ bit for bit (the round after
    the last one, also after a rebuild from the lead's saved state between rounds), and under DDP end at
    the one-process node of the doubled batch bit for bit. Under FSDP2 the sharded step's fp32 rounding
    (above) moves a top-k pick or a chunk's 2-bit level against the one process (6e-3 of θ's largest entry,
    measured): that comparison is the fp32 rounds' above."""
    wrapper, results = two_rank_node
    for key in (f"relay-{method}", f"relay-{method}-resumed"):
        lead, other = (r[key] for r in results)
        assert lead["own_left_out"] == other["own_left_out"] == 2, key  # rounds 2 and 3: θ whole in round 1 only
        for rank in (lead, other):
            for n, t in rank["server_theta"].items():
                assert torch.equal(rank["theta_c"][n], t), (key, n)
        for r, (a, b) in enumerate(zip(lead["updates"], other["updates"]), start=1):
            assert a["kept"] is not None and a["kept"] == b["kept"], (key, r)  # what the lead sent, byte for byte
        for n in lead["server_theta"]:
            assert torch.equal(lead["server_theta"][n], other["server_theta"][n]), (key, n)
    straight, resumed = (results[0][f"relay-{method}{s}"] for s in ("", "-resumed"))
    for n in straight["server_theta"]:
        assert torch.equal(straight["server_theta"][n], resumed["server_theta"][n]), n
    if wrapper == "fsdp":  # its sharded step's rounding moves a top-k pick: the fp32 rounds above compare it
        return
    reference = node_rounds(method, None, 2 * BATCH, halves=2, payload="topk2bit-relay", rounds=3)
    assert reference["own_left_out"] == 2
    for n in reference["server_theta"]:
        assert torch.equal(straight["server_theta"][n], reference["server_theta"][n]), n


def test_sharded_lordo_refuses_what_it_does_not_shard(tmp_path):
    """A low-rank matrix cut along the dimension its basis spans, or with a compressed E, is
    refused with a message naming the placement or the option (one gloo rank: a mesh of one)."""
    mp.spawn(_refusals_main, args=(str(tmp_path / "rendezvous"), str(tmp_path / "out")), nprocs=1, join=True)
    messages = (tmp_path / "out").read_text().split("\n---\n")
    assert "expected Shard(1), the dimension its low-rank coordinates keep" in messages[0], messages[0]
    assert "ef_density=0.5 on a sharded parameter" in messages[1], messages[1]


def _refusals_main(rank: int, rendezvous: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lordo_fed.optim import LoRDO

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    messages = []
    for placement, density in ((Shard(0), 1.0), (Shard(1), 0.5)):
        wide = torch.nn.Parameter(distribute_tensor(torch.randn(8, 16), mesh, [placement]))  # left projection
        wide.grad = distribute_tensor(torch.randn(8, 16), mesh, [placement])
        opt = LoRDO([wide], rank=2, ef_density=density, projection_source="local")
        try:
            opt.step()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    with open(out, "w") as f:
        f.write("\n---\n".join(messages))
    leave()


def _uneven_main(rank: int, rendezvous: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from lordo_fed.optim.sharded import chunk_of, coords_mean, shard_placement

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    checks = []
    for shape in ((5, 3), (3, 7), (7,), (1,)):  # chunks of 3 and 2 rows, of 4 and 3 columns, 1-D, one empty
        whole = torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 1
        param = distribute_tensor(whole, mesh, [shard_placement(whole)])
        mine = chunk_of(whole, param)
        checks.append(torch.equal(mine, param.to_local()))  # cut as DTensor (and FSDP2) cuts
        checks.append(torch.equal(gather(mine, param), whole))
        if whole.ndim == 2:
            checks.append(torch.allclose(coords_mean(mine, param), whole.mean()))
            stack = torch.stack([mine, 2 * mine])
            checks.append(torch.allclose(coords_mean(stack, param).flatten(), torch.stack([whole.mean(), 2 * whole.mean()])))
    with open(f"{out}.{rank}", "w") as f:
        f.write(" ".join(str(c) for c in checks))
    leave()


def test_chunks_gathers_and_means_agree_with_the_whole_tensor(tmp_path):
    """`sharded`'s cut (`chunk_of`) is DTensor's, also when the chunks are uneven or one is empty;
    `gather` undoes it; the QH mean over a matrix's chunks (`coords_mean`) is the whole one's."""
    mp.spawn(_uneven_main, args=(str(tmp_path / "rendezvous"), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        checks = (tmp_path / f"out.{rank}").read_text().split()
        assert len(checks) == 12 and all(c == "True" for c in checks), (rank, checks)


def test_bad_local_ranks_are_refused():
    with pytest.raises(ValueError, match="intra-node wrapper 'fsdp9'"):
        LocalRanks(0, 2, "fsdp9")
    with pytest.raises(ValueError, match="rank=2 of world=2"):
        LocalRanks(2, 2)
    assert LocalRanks.from_environment() is None or os.environ.get("WORLD_SIZE", "1") != "1"


@pytest.mark.slow
@pytest.mark.extended  # the CI lane runs one-rank node workers in a deployment with this kill and restart
# (test_node_worker.py) and two-rank node workers under torchrun, killed and resumed, above
def test_two_nodes_of_two_ranks_match_the_reference_with_the_doubled_batch(tmp_path):
    """A real deployment: two SuperNodes, each with a node worker of two ranks (torchrun, gloo)
    on the gRPC data plane, node 0's sharing gradients by DDP and node 1's sharded by FSDP2, over
    three overlapped rounds (both ranks train the next round's early steps on a thread while the
    lead uploads and hands on the next job); node 1's torchrun is SIGKILLed once round 1 is saved
    (its ranks die with it), and the worker restarted: both ranks resume from the lead's saved copy
    of the node's state (each cut to its chunk), the round it sent included. The run ends at the θ of the
    reference trainer with two workers of the doubled batch (to fp32 rounding, as above), each node weighted by both ranks' tokens, and each node sends
    one reply the size of a one-process worker's (only the lead talks)."""
    import signal

    from lordo_fed.checkpoint import load_checkpoint
    from harness.deployment import Deployment
    from harness.flower import check_run
    from harness.node_workers import node_worker_ranks, start_node_worker
    from harness.processes import alive, stop_process, wait_for
    from tests.integration.test_flower_app import APP, reference_theta, server_records, tiny_run_config
    from tests.integration.test_node_worker import wait_for_round_1_saved
    from tests.integration.test_reliability import Background

    socks = [tmp_path / f"nw{i}.sock" for i in range(2)]
    logs = [tmp_path / f"node-worker-{i}.log" for i in range(2)]
    wrappers = ("ddp", "fsdp")
    workers = [start_node_worker(s, log, ranks=2, timeout=120, intra_node=w) for s, log, w in zip(socks, logs, wrappers)]
    out = tmp_path / "out"
    cfg = tiny_run_config(tmp_path, **{"num-server-rounds": 3, "data-plane-insecure": True, "output-dir": str(out),
                                       "overlap-delay": 2})
    try:
        with Deployment(tmp_path, num_nodes=2, node_configs=[{"node-worker": f"unix://{s}"} for s in socks]) as dep:
            run = Background(dep.run, APP, cfg, timeout=300, log_path=tmp_path / "run.log")
            wait_for_round_1_saved(out, run, tmp_path / "run.log")
            ranks = node_worker_ranks(workers[1])
            assert len(ranks) == 2, ranks
            os.killpg(workers[1].pid, signal.SIGKILL)  # torchrun's group; its ranks die with it (node/lifeline.py)
            workers[1].wait(timeout=10)
            wait_for(lambda: not alive(ranks), 10, interval=0.05, what="node 1's ranks to die with their torchrun")
            workers[1] = start_node_worker(socks[1], logs[1], ranks=2, timeout=120, intra_node=wrappers[1])
            check_run(run.result(300))
            pids = dep.all_pids()
        assert not alive(pids)
    finally:
        for w in workers:
            stop_process(w)
    assert all(f"lead of 2 ranks, {w}" in log.read_text() for log, w in zip(logs, wrappers)), logs[0].read_text()[-2000:]
    records = server_records(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert all(r["clients_ok"] == 2 and r["clientapps_with_torch"] == 0 for r in records[1:]), records
    assert all(r["clients_fresh_state"] == 0 for r in records[1:]), "the restarted node lost its state"
    assert [r["clients_overlapped"] for r in records[1:]] == [0, 2, 2], records
    doubled = {**cfg, "batch-size": 2 * cfg["batch-size"]}
    assert records[-1]["tokens"] == 3 * 2 * cfg["local-steps"] * doubled["batch-size"] * cfg["seq-len"]
    tensors, _ = load_checkpoint(out / "checkpoints")
    theta = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
    reference = reference_theta(doubled, workers=2)
    worst = max((theta[n] - reference[n]).abs().max().item() for n in reference)
    assert worst <= 1e-4, f"max |θ_two_rank_nodes − θ_reference| = {worst}"
    # one voice per node: the reply is Δ and the due moments of one worker, whatever the ranks
    one_worker = 4 * sum(t.numel() for t in reference.values())
    assert all(one_worker <= r["bytes_received_per_client"] < 1.5 * one_worker for r in records[1:]), records


def test_a_node_workers_ranks_die_with_its_torchrun(tmp_path):
    """torchrun starts every rank in a session of its own: a SIGKILL to the torchrun agent alone
    (its process group is itself) must still end both ranks of the node worker, within seconds,
    rather than leave them holding the node's socket and device under init."""
    import signal

    from harness.node_workers import node_worker_ranks, start_node_worker
    from harness.processes import alive, stop_process, wait_for

    worker = start_node_worker(tmp_path / "nw.sock", tmp_path / "node-worker.log", ranks=2, timeout=120)
    try:
        log = tmp_path / "node-worker.log"
        wait_for(lambda: "follows the lead" in log.read_text() and len(node_worker_ranks(worker)) == 2, 60,
                 what="both ranks up")
        ranks = node_worker_ranks(worker)
        os.kill(worker.pid, signal.SIGKILL)  # the agent only: its ranks are in sessions of their own
        worker.wait(timeout=10)
        wait_for(lambda: not alive(ranks), 5, interval=0.05, what=f"ranks {sorted(ranks)} to die with their torchrun")
    finally:
        stop_process(worker)


def _follower_main(rank: int, rendezvous: str, ready: str) -> None:
    from datetime import timedelta

    from lordo_fed.node.service import follow

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    open(f"{ready}.{rank}", "w").close()
    if rank == 0:
        time.sleep(300)  # the lead, idle: SIGKILLed by the test
        exit_rank(0)
    try:
        follow(LocalRanks(rank, 2, control=control))
    except RuntimeError as err:  # the lead is gone: as the node worker does (lordo_fed/node/__main__.py)
        with open(f"{ready}.error", "w") as f:
            f.write(str(err))
        exit_rank(1)
    exit_rank(0)


def test_a_follower_leaves_when_its_lead_dies(tmp_path):
    """A follower waits for the lead's next job in a gloo broadcast: when the lead dies (SIGKILL,
    no torchrun to stop the others), the broadcast raises at once ("Connection closed by peer"),
    not after the rank timeout (300 s here), and the follower's process ends."""
    import signal

    ctx = mp.start_processes(_follower_main, args=(str(tmp_path / "rendezvous"), str(tmp_path / "ready")), nprocs=2,
                             join=False, start_method="spawn")
    lead, follower = ctx.processes
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and follower.is_alive(), "the ranks did not start"
            time.sleep(0.1)
        os.kill(lead.pid, signal.SIGKILL)
        follower.join(30)
        assert not follower.is_alive(), "the follower outlived its lead"
        assert follower.exitcode == 1 and (tmp_path / "ready.error").exists(), follower.exitcode  # follow() raised
    finally:
        for p in (lead, follower):
            if p.is_alive():
                p.kill()
            p.join(10)


def _dead_peer_main(rank: int, rendezvous: str, out: str) -> None:
    import time
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    ranks = LocalRanks(rank, 2, control=control)
    assert bytes(ranks.broadcast_bytes(b"job" if ranks.lead else None)) == b"job"
    if rank == 1:
        os._exit(0)  # a rank dies between jobs
    started = time.monotonic()
    try:
        ranks.broadcast_bytes(b"next job")
        outcome = "no error"
    except Exception as err:  # noqa: BLE001
        outcome = f"{type(err).__name__}: {err}"
    with open(out, "w") as f:
        f.write(f"{time.monotonic() - started:.1f}\n{outcome}")
    os._exit(0)


def test_a_dead_rank_fails_the_leads_next_job_instead_of_hanging(tmp_path):
    """The lead hands a job on to a rank that has died: the collective raises (the node's job
    fails and the server goes on without the node), within the rank timeout, instead of hanging."""
    out = tmp_path / "outcome"
    mp.spawn(_dead_peer_main, args=(str(tmp_path / "rendezvous"), str(out)), nprocs=2, join=True)
    seconds, outcome = out.read_text().split("\n", 1)
    assert outcome != "no error" and float(seconds) < 25, outcome
