"""Sources of the numbers: device memory backends (CUDA, the host, the shared accounting behind SimulatedGPU),
telemetry, byte units."""
