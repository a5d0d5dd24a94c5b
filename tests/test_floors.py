"""The pins `make test-oldest` installs: one per requirement, at its lower bound."""

from pathlib import Path

import pytest

from floors import floor_pin, floor_pins

ROOT = Path(__file__).resolve().parent.parent


def test_floor_pin_takes_the_lower_bound():
    assert floor_pin("onnx>=1.17") == "onnx==1.17"
    assert floor_pin("transformers>=5.0,<6") == "transformers==5.0"
    assert floor_pin("tensorrt-rtx-cu13>=1.7.1.116,<1.8") == "tensorrt-rtx-cu13==1.7.1.116"
    assert floor_pin("tritonclient[grpc,http]>=2.51") == "tritonclient==2.51"
    assert floor_pin("nvidia-pytriton==0.7.0") == "nvidia-pytriton==0.7.0"
    with pytest.raises(ValueError, match="no lower bound"):
        floor_pin("pyarrow<26")


def test_every_requirement_of_the_project_has_a_floor():
    pins = floor_pins(ROOT / "pyproject.toml", skip=("tensorrt",))
    names = [p.split("==")[0].lower() for p in pins]
    assert len(names) == len(set(names))
    for name in ("torch", "transformers", "onnx", "onnxscript", "triton", "click", "huggingface_hub"):
        assert name in names
    assert "tensorrt" not in names
    assert all("==" in p and p.split("==")[1][0].isdigit() for p in pins)
