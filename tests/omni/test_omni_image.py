"""An image pipeline (Flux) through ``Omni(model=dir).generate`` on neuron equals diffusers'
``FluxPipeline`` on the CPU, in 8-bit pixels."""
import numpy as np
import pytest
from omni_tiny_flux import PROMPT, REQUEST


@pytest.fixture(scope="module")
def omni(flux_dir):
    from vllm_omni import Omni
    engine = Omni(model=str(flux_dir), dtype="float32")
    yield engine
    engine.close()


def _generate(omni, seed, **request):
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    out = omni.generate([PROMPT], OmniDiffusionSamplingParams(seed=seed, **{**REQUEST, **request}))
    assert len(out) == 1 and out[0].error is None, out
    return np.asarray(out[0].images[0])


def _modelled(omni):
    (summary,), = omni.engine.collective_rpc("modelled_summary")   # one stage, one worker
    return summary


def test_startup_warmup_is_not_a_request(omni):
    # Runs first, on a fresh engine: Omni's 512x512 warm-up request ran at start-up.
    s = _modelled(omni)
    assert s["requests"] == 0 and s["modelled_seconds"] == 0.0


def test_modelled_time_of_requests(omni):
    omni.engine.collective_rpc("reset_modelled_summary")
    _generate(omni, 0, num_inference_steps=2)
    _generate(omni, 0, num_inference_steps=4)
    s = _modelled(omni)
    assert s["platform"] == "trn2" and s["device"] == "neuron:0" and s["requests"] == 2
    two, four = s["request_seconds"]
    # Every denoising step costs the same; the text encoders and the VAE decode cost once.
    step = (four - two) / 2
    assert 0 < step < two
    assert sum(s["by_op"].values()) == pytest.approx(s["modelled_seconds"], rel=1e-9)
    assert s["modelled_seconds"] == pytest.approx(two + four, rel=1e-9)
    assert s["by_op"]["_scaled_dot_product_flash_attention_for_cpu"] > 0


@pytest.mark.parametrize("seed", [0, 7])
def test_image_equals_diffusers_on_cpu(omni, cpu_image, seed):
    image = _generate(omni, seed)
    ref = cpu_image(seed)
    assert image.shape == ref.shape == (32, 32, 3) and image.dtype == np.uint8
    # Omni runs Flux through its own transformer; float32 rounding by op order stays far
    # below half an 8-bit level here (measured: identical bytes).
    assert np.abs(image.astype(int) - ref).max() <= 1
    assert np.abs(image.astype(int) - cpu_image(seed + 1)).mean() > 10


@pytest.fixture(scope="module")
def server(flux_dir, tmp_path_factory):
    from omni_http import omni_server
    # As for vLLM's server: the worker's series reach /metrics through Prometheus'
    # multiprocess mode, which needs an empty directory named before the server starts.
    prom = tmp_path_factory.mktemp("prometheus")
    with omni_server(flux_dir, tmp_path_factory.mktemp("omni-image-server"),
                     env={"PROMETHEUS_MULTIPROC_DIR": str(prom)}) as url:
        yield url


def _post_image(server, **body):
    import requests
    return requests.post(server + "/v1/images/generations", timeout=120, json={
        "prompt": PROMPT, "size": f"{REQUEST['width']}x{REQUEST['height']}",
        "num_inference_steps": REQUEST["num_inference_steps"], "response_format": "b64_json",
        **body})


def _png(b64):
    import base64
    import io

    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_images_generations_equals_diffusers_on_cpu(server, cpu_image):
    r = _post_image(server, seed=0, n=1)
    assert r.status_code == 200, r.text[:2000]
    data = r.json()["data"]
    assert len(data) == 1
    image = _png(data[0]["b64_json"])          # PNG is lossless: the same bytes as offline
    assert image.shape == (32, 32, 3)
    assert np.abs(image.astype(int) - cpu_image(0)).max() <= 1


def test_concurrent_image_requests(server, cpu_image):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda s: _post_image(server, seed=s), [0, 1, 0, 1]))
    for seed, r in zip([0, 1, 0, 1], responses):
        assert r.status_code == 200, r.text[:2000]
        image = _png(r.json()["data"][0]["b64_json"])
        assert np.abs(image.astype(int) - cpu_image(seed)).max() <= 1


@pytest.mark.parametrize("body", [{"size": "32by32"}, {"num_inference_steps": 0},
                                  {"response_format": "url"}, {"model": "no-such-model"}])
def test_bad_image_request_keeps_serving(server, body):
    import requests
    r = _post_image(server, **body)
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text[:2000])
    assert requests.get(server + "/health", timeout=10).status_code == 200


def _series(server, name):
    import requests
    text = requests.get(server + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and 'platform="trn2"' in line)


def test_metrics_count_each_request_modelled_time(server):
    count = "neuron:modelled_diffusion_request_seconds_count"
    total = "neuron:modelled_diffusion_request_seconds_sum"
    before = _series(server, count), _series(server, total)
    assert _post_image(server, seed=3).status_code == 200
    after = _series(server, count), _series(server, total)
    assert after[0] == before[0] + 1
    assert after[1] > before[1]
    assert _series(server, "neuron:modelled_diffusion_busy_seconds_total") == pytest.approx(
        after[1], rel=1e-9)     # the warm-up request is in neither
