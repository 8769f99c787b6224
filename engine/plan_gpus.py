"""The GPU models the serving planner (engine/plan.py) knows: HBM size and bandwidth, dense tensor-core
rates per precision, GPU-to-GPU and host link bandwidth, and the disk it assumes.

Every figure is dense (no 2:4 sparsity) and every bandwidth per direction; a sheet's sparse figure is
twice the dense one, a "bidirectional" link figure twice the per-direction one. Sources, by title
and date as far as we know them (no addresses: the vendors move their PDFs):
- NVIDIA H100 SXM5: "NVIDIA H100 Tensor Core GPU" datasheet (NVIDIA, 2022-23; the edition giving the
  SXM part 3.35 TB/s), H100 SXM column: 80 GB HBM3, 3.35 TB/s; BF16 1,979 and FP8 3,958 TFLOP/s
  "with sparsity", so 989 / 1,979 dense; NVLink 900 GB/s and PCIe Gen5 128 GB/s, both two-way totals.
- NVIDIA H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet (NVIDIA, 2024; the part was announced at
  SC23, November 2023), H200 SXM column: 141 GB HBM3e, 4.8 TB/s; tensor rates, NVLink and PCIe as
  the H100 SXM's.
- NVIDIA B200: the HGX B200 column of NVIDIA's HGX platform specifications (2024-25) and of the
  "NVIDIA Blackwell Architecture Technical Brief" (2024), with the "NVIDIA DGX B200" datasheet (2024)
  for memory: eight GPUs share 1,440 GB of HBM3e at 64 TB/s, so 180 GB and 8 TB/s each; FP4 144, FP8
  72, BF16 36 PFLOP/s sparse for eight, so 9 / 4.5 / 2.25 PFLOP/s dense per GPU (at the HGX part's
  1,000 W); NVLink 5 1.8 TB/s two-way per GPU. Host link: taken as PCIe Gen5 x16.
- AMD Instinct MI300X: "AMD Instinct MI300X Accelerator" data sheet (AMD, 2023-24; launched December
  2023): 192 GB HBM3, 5.3 TB/s peak; peak BF16 1,307.4 and FP8 2,614.9 TFLOP/s dense (2,614.9 /
  5,229.8 with sparsity); no FP4; 7 Infinity Fabric links of 128 GB/s two-way each (448 GB/s per
  direction in all); PCIe Gen5 x16 (128 GB/s two-way).
GPUs without FP4 tensor cores run FP4 weights at their FP8 rate (unpacked on the fly).
Disk (no datasheet: an assumption, one PCIe Gen4 NVMe drive per GPU): 1 M random 4 KiB reads/s, 7 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    hbm_bytes: float
    hbm_Bps: float
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float          # 0: no FP4 tensor cores (FP4 runs at the FP8 rate)
    link_Bps: float           # GPU-to-GPU, per direction
    host_Bps: float           # host link, per direction

    def rate(self, precision: str) -> float:
        if precision == "fp4":
            return self.fp4_flops or self.fp8_flops
        return self.fp8_flops if precision == "fp8" else self.bf16_flops


GPUS = {g.key: g for g in (
    GPU("h100", "NVIDIA H100 SXM", 80e9, 3.35e12, 989e12, 1979e12, 0.0, 450e9, 64e9),
    GPU("h200", "NVIDIA H200 SXM", 141e9, 4.8e12, 989e12, 1979e12, 0.0, 450e9, 64e9),
    GPU("b200", "NVIDIA B200 (HGX)", 180e9, 8.0e12, 2250e12, 4500e12, 9000e12, 900e9, 64e9),
    GPU("mi300x", "AMD Instinct MI300X", 192e9, 5.3e12, 1307.4e12, 2614.9e12, 0.0, 448e9, 64e9),
)}
DISK_IOPS, DISK_Bps, DISK_PAGE = 1e6, 7e9, 4096
