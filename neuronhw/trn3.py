"""Trainium3: NeuronCore-v4 (NKI target gen4)."""
from .profile import GiB, KiB, ChipProfile

TRN3 = ChipProfile(
    name="trn3", chip="Trainium3", core_version="NeuronCore-v4", nki_target="gen4",
    physical_cores=8, hbm_bytes=144 * GiB, hbm_bandwidth=4.9e12,
    # 671 BF16 / 2517 FP8 / 2517 MXFP8 and MXFP4 ("mx") / 183 FP32 dense TFLOPS per chip
    # over 8 cores.
    core_tflops={"bfloat16": 79.0, "float16": 79.0, "float8": 315.0, "float4": 315.0,
                 "mx": 315.0, "float32": 20.0},
    tensor_clock=2.4e9, vector_clock=1.2e9, scalar_clock=1.2e9, gpsimd_clock=1.2e9,
    sbuf_partition_bytes=256 * KiB, psum_partition_bytes=16 * KiB,
    dma_queue_bytes_per_ns=33.0,
    neuronlink_bandwidth=2.56e12, default_lnc=2,
)
