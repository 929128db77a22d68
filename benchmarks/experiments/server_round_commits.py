"""Diagnostic (not a product benchmark): one server round of `diloco-sparse` at 125m (GPT-2
vocabulary, M replies of random top-k Δ, round 2: θ's compressed change down) timed in whichever tree
is first on PYTHONPATH, on one CPU thread: screening (decode, check) and aggregation (sums, outer step,
downlink, clients' copy). `dense-twice` runs on any commit (decoded to dense fp32 on arrival and again
on load), `sparse-once` needs `decode_update(..., sparse=True)`. Used to compare a commit before the
sparse decode with one after it (docs/results.md section 12, part eleven):

    git worktree add /tmp/before 81d821b
    (cd /tmp/before && PYTHONPATH=$PWD python $OLDPWD/benchmarks/experiments/server_round_commits.py 4 dense-twice)
    PYTHONPATH=$PWD python benchmarks/experiments/server_round_commits.py 4 sparse-once

Prints one JSON line; `theta_sum` (Σ θ in fp64) tells whether two trees reached the same θ.
"""
import json
import sys
import time

import torch
torch.set_num_threads(1)
from lordo_fed.app.config import load_app_config
from lordo_fed.rounds.build import build_run
from lordo_fed.rounds.screening import ReplyRef
from lordo_fed.wire.compress import ErrorFeedback
from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import encode_update
from lordo_fed.wire.messages import WorkerUpdate
M, path = int(sys.argv[1]), sys.argv[2]
cfg = load_app_config({"preset": "diloco-sparse", "model-preset": "125m"})
run = build_run(cfg, "diloco", vocab_size=50257, device=torch.device("cpu"))
codecs, specs = run.payload.codecs, run.payload.receiver_specs
g = torch.Generator().manual_seed(0)
params = {n: p.detach() for n, p in run.model.named_parameters()}
deltas = [{n: ErrorFeedback().compress(n, torch.randn(p.shape, generator=g) * 1e-3, codecs.delta_spec(n, tuple(p.shape)))[0]
           for n, p in params.items()} for _ in range(M)]
agg = run.aggregator()
for r in range(2):
    payloads = [bytes(encode_update(WorkerUpdate(m, agg.round, d, {}, 4096, 4), run.model_id)) for m, d in enumerate(deltas)]
    t0 = time.perf_counter()
    refs = []
    for data in payloads:
        if path == "sparse-once":
            u = decode_update(data, run.model_id, codecs=specs, sparse=True); load = None
        else:
            u = decode_update(data, run.model_id, codecs=specs); load = (lambda data=data: decode_update(data, run.model_id, codecs=specs))
        reason, norm = agg.check_reply(u)
        assert reason is None
        refs.append(ReplyRef.of(u, load=load, norm=norm)); del u
    t1 = time.perf_counter()
    agg.aggregate_refs(refs)
    agg.client_copy()
    t2 = time.perf_counter()
print(json.dumps({"M": M, "path": path, "screen_s": t1 - t0, "aggregate_s": t2 - t1,
                  "theta_sum": float(sum(p.double().sum() for p in agg.params.values()))}))
