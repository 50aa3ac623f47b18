import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test starts with no compiled frames (the disk cache still speeds compiles up).
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
