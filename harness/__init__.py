"""Development-only helpers shared by the tests and the benchmarks (not installed with the package):
`harness.flower` runs a Flower app (its environment, the `flwr` CLI, simulation),
`harness.deployment` a real SuperLink + SuperNodes, `harness.node_workers` the node workers
(lordo_fed/node/) they hand rounds to, and `harness.processes` stops every process they start;
`harness.apps` holds the throwaway Flower apps they run."""
