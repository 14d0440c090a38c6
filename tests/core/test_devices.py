"""hvdp.core.devices: which device each rank takes, and the check that no two ranks share a GPU unasked."""

import pytest

from hvdp.core.devices import DeviceRequest, gpu_index, request, shared_gpus, sharing_error
from hvdp.core.errors import ConfigError


def test_request_from_arguments_then_environment():
    assert request(env={}) == DeviceRequest("auto", None, False)
    assert request("CUDA:1", env={}) == DeviceRequest("cuda", 1, False)
    assert request(env={"HVDP_DEVICE": "cpu", "HVDP_SHARE_GPUS": "1"}) == DeviceRequest("cpu", None, True)
    # an argument wins over the environment
    assert request("cuda", False, env={"HVDP_DEVICE": "cpu", "HVDP_SHARE_GPUS": "1"}) == DeviceRequest("cuda")


@pytest.mark.parametrize("device, env, message", [
    ("gpu", {}, "device='gpu' is not a device"),
    ("cpu:0", {}, "device='cpu:0' is not a device"),
    ("cuda:x", {}, "device='cuda:x' is not a device"),
    (None, {"HVDP_DEVICE": "tpu"}, "HVDP_DEVICE='tpu' is not a device"),
    (None, {"HVDP_SHARE_GPUS": "yes"}, "HVDP_SHARE_GPUS='yes'"),
])
def test_bad_requests_name_where_they_came_from(device, env, message):
    with pytest.raises(ConfigError, match=message):
        request(device, env=env)


def test_each_local_rank_takes_its_own_gpu():
    auto = DeviceRequest("auto")
    assert [gpu_index(auto, r, 8) for r in range(8)] == list(range(8))
    assert [gpu_index(auto, r, 4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # then shared_gpus() objects
    assert gpu_index(auto, 5, 1) == 0  # a rank that sees only its own GPU (Slurm --gpus-per-task) takes it
    assert gpu_index(auto, 3, 0) is None and gpu_index(DeviceRequest("cpu"), 0, 8) is None
    assert gpu_index(DeviceRequest("cuda", 2), 0, 4) == 2
    with pytest.raises(ConfigError, match="sees no GPU"):
        gpu_index(DeviceRequest("cuda"), 0, 0)
    with pytest.raises(ConfigError, match=r"cuda:4 was asked for, but this process sees 4 GPU\(s\) \(0..3\)"):
        gpu_index(DeviceRequest("cuda", 4), 0, 4)


def test_ranks_on_one_gpu_are_found_and_named():
    # 4 ranks on host a with 2 GPUs (ranks 0 and 2 on GPU A0), one on host b, one on the CPU
    placements = [("a", "A0"), ("a", "A1"), ("a", "A0"), ("a", "A1"), ("b", "A0"), None]
    shared = shared_gpus(placements)
    assert shared == {("a", "A0"): [0, 2], ("a", "A1"): [1, 3]}, "the same GPU id on another host is another GPU"
    message = sharing_error(shared, 2)
    assert "ranks [0, 2] on host a would all use GPU A0" in message
    assert "at most 2 rank(s) per host (horovodrun -H a:2)" in message and "HVDP_SHARE_GPUS=1" in message
    assert shared_gpus([("a", "A0"), ("a", "A1"), None, None]) == {} and sharing_error({}, 2) is None
