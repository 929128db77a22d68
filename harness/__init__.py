"""Development-only helpers shared by the tests and the benchmarks (not installed with the package):
`harness.flower` runs real Flower processes (simulation, SuperLink + SuperNodes) and stops every
one it starts; `harness.apps` holds the throwaway Flower apps they run."""
