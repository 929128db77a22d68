"""lordo_fed.node.channel.run_on_node_worker: a worker that dies during a job (killed, restarted by its
supervisor) gets the same job again, once, on the new worker; a second death, or a refusal, fails the
round with the address and the status. The worker here is a stand-in process that serves the real
NodeWorker service on a unix socket and records each job it receives; the first one dies in the middle
of its first job (os._exit, as a SIGKILL mid-upload leaves it).

These tests found a race in the retry: gRPC shared one connection between the channels to an address, so
the second try could be sent on the dead worker's connection before it was marked broken and fail at once
('Stream removed (sendmsg: Broken pipe)'; the second-death test saw one job where two were sent, 4 times in
120 runs of its scenario), where it should wait for the restarted worker. Each channel now has its own
connection (`grpc.use_local_subchannel_pool`: 0 in 150 runs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lordo_fed.node.channel import NodeWorkerError, run_on_node_worker

WORKER = textwrap.dedent('''
    import json, os, sys, time
    from concurrent import futures
    import grpc
    from lordo_fed.v1 import node_pb2 as pb, node_pb2_grpc as pb_grpc

    sock, jobs, behaviour = sys.argv[1], sys.argv[2], sys.argv[3]

    class Worker(pb_grpc.NodeWorkerServicer):
        def Run(self, job, context):
            with open(jobs, "ab") as f:  # what each worker received, for the test to compare
                f.write(job.SerializeToString().hex().encode() + b"\\n")
            if behaviour == "die":
                time.sleep(0.2)  # in the middle of the job
                os._exit(9)
            if behaviour == "refuse":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run config: rank=-3")
            return pb.NodeResult(payload=job.payload[::-1], metrics={"pid": float(os.getpid())})

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_NodeWorkerServicer_to_server(Worker(), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    server.wait_for_termination()
''')


class Supervisor:
    """Starts a stand-in worker per behaviour in turn on one socket: the next as soon as the last exits."""

    def __init__(self, tmp_path: Path, behaviours: list[str]):
        self.sock = tmp_path / "worker.sock"
        self.jobs = tmp_path / "jobs.txt"
        self.script = tmp_path / "worker.py"
        self.script.write_text(WORKER)
        self.procs: list[subprocess.Popen] = []
        self.behaviours = list(behaviours)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        for behaviour in self.behaviours:
            self.sock.unlink(missing_ok=True)
            proc = subprocess.Popen([sys.executable, str(self.script), str(self.sock), str(self.jobs), behaviour])
            self.procs.append(proc)
            while proc.poll() is None:
                if self._stop.is_set():
                    return
                time.sleep(0.02)

    @property
    def address(self) -> str:
        return f"unix://{self.sock}"

    def received(self) -> list[bytes]:
        return [bytes.fromhex(line) for line in self.jobs.read_text().split()] if self.jobs.exists() else []

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def supervisor(tmp_path, request):
    sup = Supervisor(tmp_path, request.param)
    yield sup
    sup.close()


def run(sup: Supervisor, timeout: float = 60.0):
    return run_on_node_worker(sup.address, "train", 7, {"rank": 8}, ("rank",), {"partition-id": 1}, node_id=42,
                              ticket=b"", payload=b"state-of-round-3", timeout=timeout)


@pytest.mark.parametrize("supervisor", [["die", "serve"]], indirect=True)
def test_a_worker_that_dies_mid_job_gets_the_same_job_again_on_its_restarted_successor(supervisor):
    result = run(supervisor)
    first, second = supervisor.procs
    assert first.returncode == 9  # it did die in the middle of the job
    assert result.payload == b"state-of-round-3"[::-1]  # the successor's answer to the same job
    assert result.metrics["pid"] == second.pid
    jobs = supervisor.received()
    assert len(jobs) == 2 and jobs[0] == jobs[1]  # the same job, byte for byte
    from lordo_fed.v1 import node_pb2 as pb

    job = pb.NodeJob.FromString(jobs[1])
    assert (job.kind, job.run_id, job.node_id, json.loads(job.run_config_json)) == ("train", 7, 42, {"rank": 8})


@pytest.mark.parametrize("supervisor", [["die", "die", "serve"]], indirect=True)
def test_a_second_death_fails_the_round_instead_of_a_third_try(supervisor):
    with pytest.raises(NodeWorkerError, match=r"node worker at unix://.*worker\.sock: UNAVAILABLE"):
        run(supervisor)
    assert len(supervisor.received()) == 2


@pytest.mark.parametrize("supervisor", [["refuse", "serve"]], indirect=True)
def test_a_refused_job_fails_at_once_with_the_workers_reason(supervisor):
    with pytest.raises(NodeWorkerError, match=r"INVALID_ARGUMENT: run config: rank=-3"):
        run(supervisor)
    assert len(supervisor.received()) == 1 and supervisor.procs[0].poll() is None  # not tried again


def test_no_worker_within_the_deadline_fails_with_deadline_exceeded(tmp_path):
    with pytest.raises(NodeWorkerError, match="DEADLINE_EXCEEDED"):
        run_on_node_worker(f"unix://{tmp_path / 'nobody.sock'}", "train", 1, {}, (), {}, node_id=1, timeout=0.5)


def test_the_channel_refuses_an_address_off_the_machine():
    with pytest.raises(ValueError, match="the local channel stays on this machine"):
        run_on_node_worker("10.0.0.7:5000", "train", 1, {}, (), {}, node_id=1, timeout=1)
