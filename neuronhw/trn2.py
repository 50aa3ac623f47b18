"""Trainium2: NeuronCore-v3 (NKI target gen3)."""
from .profile import GiB, KiB, ChipProfile

TRN2 = ChipProfile(
    name="trn2", chip="Trainium2", core_version="NeuronCore-v3", nki_target="gen3",
    physical_cores=8, hbm_bytes=96 * GiB, hbm_bandwidth=2.9e12,
    # 667 BF16 / 1299 FP8 / 181 FP32 dense TFLOPS per chip over 8 cores.
    core_tflops={"bfloat16": 79.0, "float16": 79.0, "float8": 158.0, "float32": 20.0},
    tensor_clock=2.4e9, vector_clock=0.96e9, scalar_clock=1.2e9, gpsimd_clock=1.2e9,
    sbuf_partition_bytes=224 * KiB, psum_partition_bytes=16 * KiB,
    dma_queue_bytes_per_ns=23.0,
    neuronlink_bandwidth=1.28e12, default_lnc=2,
)
