"""Trainium1: NeuronCore-v2 (NKI target gen2)."""
from .profile import GiB, KiB, ChipProfile

TRN1 = ChipProfile(
    name="trn1", chip="Trainium1", core_version="NeuronCore-v2", nki_target="gen2",
    physical_cores=2, hbm_bytes=32 * GiB, hbm_bandwidth=820e9,
    core_tflops={"bfloat16": 92.0, "float16": 92.0, "float8": 92.0, "float32": 23.0},
    tensor_clock=2.8e9, vector_clock=1.12e9, scalar_clock=1.4e9, gpsimd_clock=1.4e9,
    sbuf_partition_bytes=192 * KiB, psum_partition_bytes=16 * KiB,
    dma_queue_bytes_per_ns=16.0,
    neuronlink_bandwidth=384e9, default_lnc=1, supports_lnc2=False,
)
