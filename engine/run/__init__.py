"""Running the model: loading and runs (api), the probe format (probes), the CPU wavefront
(pipeline), the kernel-vs-reference parity checks (parity)."""
