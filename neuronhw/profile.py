"""The hardware profile: one frozen dataclass of numbers per chip.

Every figure comes from AWS's public architecture pages (see docs/hardware.md). Nothing here
computes; the cost model (``torch_neuronx.cost_model``) and the NKI simulator read these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30
KiB = 1 << 10


@dataclass(frozen=True)
class ChipProfile:
    name: str                      # "trn2"
    chip: str                      # "Trainium2"
    core_version: str              # "NeuronCore-v3"
    nki_target: str                # "gen3": NKI's name for the architecture
    physical_cores: int            # NeuronCores per chip
    hbm_bytes: int                 # per chip
    hbm_bandwidth: float           # bytes/s per chip
    # Dense TFLOPS per physical core by dtype name ("bfloat16", "float8", "float32", ...);
    # "mx" is the MXFP8/MXFP4 block-scaled matmul rate, absent on chips without one.
    core_tflops: dict = field(default_factory=dict)
    # Engine clocks in Hz.
    tensor_clock: float = 2.4e9
    vector_clock: float = 0.96e9
    scalar_clock: float = 1.2e9
    gpsimd_clock: float = 1.2e9
    # On-chip memories per physical core.
    partitions: int = 128
    sbuf_partition_bytes: int = 192 * KiB
    psum_partition_bytes: int = 16 * KiB
    psum_banks: int = 8
    psum_bank_bytes: int = 2 * KiB      # per partition: 512 fp32
    pe_rows: int = 128                  # TensorE systolic array
    pe_cols: int = 128
    gemm_moving_fmax: int = 512
    # Fixed costs.
    min_ii_cycles: int = 64             # minimum instruction initiation interval
    engine_access_overhead_cycles: int = 60
    dma_fixed_ns: float = 600.0         # descriptor-generated DMA instruction
    semaphore_ns: float = 1300.0        # cross-engine semaphore-to-start
    dma_queue_bytes_per_ns: float = 23.0
    dma_queues: int = 16
    # Fixed per-row (per contiguous run) DMA cost in byte-equivalents: rows of >= ~2 KiB per
    # partition approach the queue's peak bandwidth, small rows do not.
    dma_row_overhead_bytes: int = 512
    # Queues one DMA instruction's descriptors are spread over (the rest serve other DMAs).
    dma_queues_per_instruction: int = 4
    launch_overhead_ns: float = 2000.0  # host-to-device kernel launch on the runtime
    host_link_bandwidth: float = 32e9   # bytes/s host<->device (PCIe) per logical core
    vector_lanes: int = 128             # elements per cycle of VectorE / ScalarE / GpSimd
    # Interconnect.
    neuronlink_bandwidth: float = 1.28e12   # bytes/s per chip
    neuronlink_latency_ns: float = 2000.0
    efa_bandwidth: float = 400e9 / 8        # bytes/s per instance link (EFA, 400 Gbit/s)
    efa_latency_ns: float = 15000.0
    default_lnc: int = 2
    supports_lnc2: bool = True

    def logical_cores(self, lnc: int) -> int:
        return self.physical_cores // lnc

    def core_hbm_bytes(self, lnc: int) -> int:
        """HBM that one logical core owns."""
        return self.hbm_bytes // self.logical_cores(lnc)

    def core_hbm_bandwidth(self, lnc: int) -> float:
        return self.hbm_bandwidth / self.logical_cores(lnc)

    def peak_flops(self, dtype: str, lnc: int = 1) -> float:
        """Dense FLOP/s of one logical core for a dtype name; unknown dtypes run at fp32 rate."""
        tf = self.core_tflops.get(dtype, self.core_tflops["float32"])
        return tf * 1e12 * lnc

    @property
    def sbuf_bytes(self) -> int:
        return self.partitions * self.sbuf_partition_bytes

    @property
    def psum_bytes(self) -> int:
        return self.partitions * self.psum_partition_bytes
