"""EXPERIMENTS for benchmarks/round_overhead.py, not stock Flower: what the per-round overhead
would be without Flower 1.41's process-per-message ClientApps and its hard-coded SuperNode waits.

Both use Flower internals (flwr 1.41/1.42; checked against the installed source) and are not used
by the app, the tests or the scripts:

- `serve-clientapp`: a long-lived ClientApp runner for `flower-supernode --isolation process`. It
  does what `flower-superexec` + `flwr-clientapp` do (AcquireTask on the SuperNode's Runtime API,
  then pull the task's message/context/FAB, call the ClientApp, push the reply and the task
  output), but in ONE process that keeps serving: the ClientApp module, torch and whatever the
  app caches (our `lordo_fed.node.runtime._RUNTIMES`: model, data, workers) survive from message to message.
  Stock `flwr-clientapp` takes one task token and exits (flwr.supernode.runtime.run_clientapp).
- `supernode`: `flower-supernode` with the `time.sleep` of its main loop capped: the SuperNode
  sleeps 3 s after every empty pull of the SuperLink (flwr/supernode/start_client_internal.py,
  not configurable) and polls its own state every 0.5 s for the ClientApp's reply. Its object
  pulls retry after 50 ms instead of 1 s (a fast poll often sees a message whose payload is
  still being uploaded).

    python benchmarks/flower_shims.py serve-clientapp --runtime-api-address 127.0.0.1:9094 [--poll 0.05]
    python benchmarks/flower_shims.py supernode --max-sleep 0.1 -- <flower-supernode arguments>
"""

from __future__ import annotations

import argparse
import sys
import time
from logging import ERROR, INFO
from pathlib import Path

HERE = Path(__file__).resolve()


def persistent_executor_command(i: int, runtime_api_address: str, supernode_pid: int) -> list[str]:
    """For harness.deployment.Deployment(isolation="process", executor_command=...)."""
    return [sys.executable, str(HERE), "serve-clientapp", "--runtime-api-address", runtime_api_address,
            "--parent-pid", str(supernode_pid)]


def supernode_command(max_sleep: float) -> list[str]:
    """For harness.deployment.Deployment(supernode_command=...): flower-supernode, waits capped."""
    return [sys.executable, str(HERE), "supernode", "--max-sleep", str(max_sleep), "--"]


def pull_task_input(client):
    """flwr.supernode.runtime.run_clientapp.pull_task_input, retrying missing objects after 20 ms
    instead of 1 s: the SuperNode offers the task before it has pulled the message's objects from
    the SuperLink, which a new `flwr-clientapp` process never notices (it needs > 1 s to start) but
    a warm runner does."""
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.app import Message

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=0.02, backoff_cap=0.5,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


def serve_clientapp(runtime_api_address: str, parent_pid: int | None, poll: float) -> None:
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.client_app import LoadClientAppError
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
    from flwr.supercore import log
    from flwr.supercore.app_utils import start_parent_process_monitor
    from flwr.supercore.constant import TaskType
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    if parent_pid is not None:
        start_parent_process_monitor(parent_pid)

    def client(component: str, *extra) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(
            server_address=runtime_api_address, insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name=component), *extra],
            retry_invoker=make_simple_http_retry_invoker())

    executor = client("SuperExec")
    load_client_app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
    installed: set[str] = set()
    log(INFO, "long-lived ClientApp runner on %s (poll %.3f s)", runtime_api_address, poll)
    while True:
        res = executor.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        if not (res.HasField("task") and res.token):
            time.sleep(poll)
            continue
        task_client = client("flwr-clientapp", RuntimeTokenHttpInterceptor(res.token))
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(task_client))
        heartbeat.start()
        message = context = reply = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        marks = [("acquired", time.perf_counter())]
        try:
            message, context, run, fab = pull_task_input(task_client)
            marks.append(("pulled", time.perf_counter()))
            if fab.hash_str not in installed:
                install_from_fab(fab.content, skip_prompt=True)
                installed.add(fab.hash_str)
            app = load_client_app(run.fab_id, run.fab_version, fab.hash_str)
            marks.append(("loaded", time.perf_counter()))
            reply = app(message=message, context=context)
            marks.append(("handled", time.perf_counter()))
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # pylint: disable=broad-exception-caught
            log(ERROR, "ClientApp raised an exception", exc_info=ex)
            code = (ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(ex, LoadClientAppError)
                    else ErrorCode.CLIENT_APP_RAISED_EXCEPTION)
            details = f"{type(ex)}:<'{ex}'>"
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(task_client, reply, context)
            except Exception as ex:  # pylint: disable=broad-exception-caught
                log(ERROR, "Failed to push reply message", exc_info=ex)
            marks.append(("pushed", time.perf_counter()))
            push_task_output(task_client, context, status, details)
            marks.append(("output", time.perf_counter()))
            heartbeat.stop()
            task_client.close()
            marks.append(("closed", time.perf_counter()))
        log(INFO, "task %s: %s", status, " ".join(f"{name} +{t - marks[0][1]:.3f}" for name, t in marks[1:]))


def run_supernode(max_sleep: float, argv: list[str]) -> None:
    import time as real_time

    import flwr.supernode.start_client_internal as sci
    from flwr.supernode.cli import flower_supernode

    class _CappedTime:
        def __getattr__(self, name):
            return getattr(real_time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            real_time.sleep(min(seconds, max_sleep))

    sci.time = _CappedTime()  # the module's `import time`: only its main loop's waits use it
    # Polling that fast, the node often pulls a message whose objects the server is still
    # uploading; `pull_objects` would then wait 1 s before retrying (the ServerApp has the same
    # issue with replies: lordo_fed.app.records.shorten_pull_backoff, used by server/courier.py).
    from lordo_fed.app.records import shorten_pull_backoff

    shorten_pull_backoff()
    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve-clientapp")
    serve.add_argument("--runtime-api-address", required=True)
    serve.add_argument("--parent-pid", type=int, default=None)
    serve.add_argument("--poll", type=float, default=0.05)
    node = sub.add_parser("supernode")
    node.add_argument("--max-sleep", type=float, default=0.1)
    node.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.cmd == "serve-clientapp":
        serve_clientapp(args.runtime_api_address, args.parent_pid, args.poll)
    else:
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        run_supernode(args.max_sleep, rest)


if __name__ == "__main__":
    main()
