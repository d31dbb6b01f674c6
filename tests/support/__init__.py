"""What the tests, the scenario generator and the benchmarks share: test doubles (fake NVML, fake
inference servers, fake Alertmanagers), the synthetic host simulator and its scenario library, and
helpers that start a real agent or a real Prometheus. Never imported by the installed agent."""
