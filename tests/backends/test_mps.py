"""Issue 30: the optional MPS binding. A sharing replica on a node with NVIDIA's MPS control daemon
gets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for exactly what vllmfit booked on each of its GPUs (format
of NVIDIA's MPS documentation: "<device ordinal>=<limit>", comma-separated; "0=22418M"), with the
daemon's pipe and log directories mounted; with the binding off nothing changes. No GPU is lent to
this test: that MPS then refuses the vLLM process memory beyond the limit is NVIDIA's to enforce
and is not shown here (docs/placement-backends.md, "Enforcement")."""

from __future__ import annotations

from typing import Any

from vllmfit.backends import binding
from vllmfit.core import defaults
from vllmfit.core.spec import api, validate
from vllmfit.operator.rendering import builders

MIB = defaults.MIB
FLAGS = api.Flags(max_model_len=8192, max_num_seqs=8, gpu_memory_utilization=0.5)
REPLICA = api.ReplicaPlacement(replica=0, node="gpu-a", gpus=[api.GpuRef(index=3, uuid="GPU-3"),
                                                                api.GpuRef(index=5, uuid="GPU-5")])
OBJ = api.VLLMDeployment.model_validate({"metadata": {"name": "llama", "namespace": "t"}, "spec": {
    "model": "meta-llama/Llama-3.1-8B-Instruct", "tensorParallelSize": 2}})


def test_the_limit_is_the_booking_per_container_ordinal_in_mib_rounded_down() -> None:
    assert binding.mps_limit([22418 * MIB, 22418 * MIB + MIB - 1]) == "0=22418M,1=22418M"
    assert binding.mps_limit([1]) == "0=0M"


def vllm_of(d: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")


def env_of(d: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in vllm_of(d)["env"]}


def test_a_sharing_replica_gets_its_booked_bytes_as_the_mps_limit() -> None:
    booked = builders.booked_text([])  # the annotation's text, as children.py writes it
    assert booked == ""
    text = f"3={20 * 1024 * MIB},5={21 * 1024 * MIB + 5}"
    d = builders.deployment(OBJ, REPLICA, FLAGS, "m", exclusive=False, booked=text, mps=binding.Mps())
    env = env_of(d)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M,1=21504M"  # GPU 3 -> ordinal 0, GPU 5 -> 1
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # ordinals in NVML (PCI) order, as vllmfit's indices
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-3,GPU-5"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == defaults.MPS_PIPE_DIRECTORY == "/tmp/nvidia-mps"
    pod = d["spec"]["template"]["spec"]
    assert {"name": binding.MPS_PIPE_VOLUME, "hostPath": {"path": "/tmp/nvidia-mps", "type": "Directory"}} \
        in pod["volumes"]
    assert {"name": binding.MPS_PIPE_VOLUME, "mountPath": "/tmp/nvidia-mps"} in vllm_of(d)["volumeMounts"]
    assert {"name": binding.MPS_LOG_VOLUME, "mountPath": defaults.MPS_LOG_DIRECTORY} in vllm_of(d)["volumeMounts"]


def test_off_by_default_and_only_for_sharing_replicas() -> None:
    text = "3=1073741824,5=1073741824"
    plain = builders.deployment(OBJ, REPLICA, FLAGS, "m", exclusive=False, booked=text)
    whole = builders.deployment(OBJ, REPLICA, FLAGS, "m", exclusive=True, booked=text, mps=binding.Mps())
    dra = builders.deployment(OBJ, REPLICA, FLAGS, "m", exclusive=False, booked=text, mps=binding.Mps(),
                              claim_template="llama-0-gpus")
    for d in (plain, whole, dra):
        assert not [n for n in env_of(d) if n.startswith("CUDA_MPS_")]
        assert not [v for v in d["spec"]["template"]["spec"]["volumes"] if "hostPath" in v]


def test_the_operator_flags_turn_it_on() -> None:
    import argparse

    from vllmfit.operator import main

    p = argparse.ArgumentParser()
    main.add_parser(p.add_subparsers())
    args = p.parse_args(["operator", "--pod-security-level", "baseline", "--allow-host-path", "/data/models",
                         "--mps-pipe-directory", "/run/nvidia/mps", "--mps-log-directory", "/l"])
    policy, mps = main.tenancy(args)
    assert (policy.level, policy.host_paths, mps) == ("baseline", ("/data/models",), binding.Mps("/run/nvidia/mps", "/l"))
    policy, mps = main.tenancy(p.parse_args(["operator"]))
    assert (policy, mps) == (validate.DEFAULT_POLICY, None)  # restricted, no host path, MPS off
