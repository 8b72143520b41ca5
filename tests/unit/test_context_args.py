"""A model's ``context_length`` reaches its engine (``llmgw.catalog.context_args``) and placement's
memory estimate alike: the context one request may use, a llama.cpp replica's ``--ctx-size`` being
shared by its slots. Before, ``context_length`` reached no engine: llama-server ran with the agent's
4096 cells (1024 a request) whatever the catalog said, while placement sized the KV cache for
``context_length`` cells (a new user's finding: ``context_length: 500`` let a 1,024-token prompt in)."""

from __future__ import annotations

from llmgw.catalog import Model, context_args
from llmgw.control.api.desired import desired_specs
from llmgw.control.placement import estimate as est
from llmgw.control.placement.inputs import effective_model, profile_estimate
from llmgw.control.store.rows import ReplicaRow
from llmgw.ggufheader import GgufFacts


def _model(context_length: int, *profiles: dict[str, object]) -> Model:
    return Model.model_validate({"name": "m", "source": "http://m/m.gguf", "context_length": context_length,
                                 "profiles": list(profiles) or [{"name": "cpu"}]})


def test_the_context_one_request_may_use_times_the_slots() -> None:
    m = _model(2048, {"name": "cpu"}, {"name": "two", "args": ["-np", "2"]}, {"name": "own", "args": ["-c", "999"]},
               {"name": "gpu", "engine": "vllm", "gpu_class": "l4-24gb"})
    cpu, two, own, gpu = m.profiles
    assert context_args(m, cpu) == ["--ctx-size", "8192"]  # 4 slots by default
    assert context_args(m, two) == ["--ctx-size", "4096"]
    assert context_args(m, own) == []  # the profile's own context stands
    assert context_args(m, gpu) == ["--max-model-len", "2048"]  # vLLM's is per request
    assert context_args(_model(0), _model(0).profiles[0]) == []  # not set: the engine's defaults


def test_the_agent_gets_it_and_placement_sizes_the_kv_cache_for_it() -> None:
    m = _model(2048)
    row = ReplicaRow(id="m-1", model="m", node="n", profile="cpu", key="k")
    (spec,) = desired_specs("n", [row], {"m": m})
    assert spec.args == ["--ctx-size", "8192"]
    facts = GgufFacts(architecture="llama", file_size=400_000_000, block_count=16, head_count=8, head_count_kv=[8],
                      key_length=64, value_length=64, embedding_length=1024, context_length=32768)
    sized = effective_model(m, {"http://m/m.gguf": facts}).profiles[0].min_memory_gb
    assert sized == -(-est.estimate(facts, ["--ctx-size", "8192"]).total_gb * 100 // 1) / 100


def test_a_shared_kv_pool_gives_any_request_the_whole_context() -> None:
    """'-np -1' (llama-server's auto) and --kv-unified share one pool across slots: counted as 4 slots,
    context_length 512 gave --ctx-size 2048 and a 1,524-token prompt was served (a new user's finding)."""
    m = _model(512, {"name": "auto", "args": ["-np", "-1"]}, {"name": "kvu", "args": ["--kv-unified", "-np", "4"]},
               {"name": "eq", "args": ["--parallel=-1"]})
    assert [context_args(m, p) for p in m.profiles] == [["--ctx-size", "512"]] * 3


def test_without_a_context_placement_sizes_what_the_agent_starts_not_the_training_context() -> None:
    """Neither the profile nor the catalog sets a context: the agent starts llama-server with
    --ctx-size 4096, and placement sizes the KV cache for 4096 cells, not for the GGUF's training
    context (here 131,072: 128 KiB a token, 16 GiB of KV that no replica would use). vLLM takes the
    model's own context by default, and is sized for it."""
    m = _model(0, {"name": "cpu"}, {"name": "gpu", "engine": "vllm", "gpu_class": "l4-24gb"})
    cpu, gpu = m.profiles
    row = ReplicaRow(id="m-1", model="m", node="n", profile="cpu", key="k")
    (spec,) = desired_specs("n", [row], {"m": m})
    assert spec.args == []  # the agent adds --ctx-size 4096 (llmgw.agent.engines.llamacpp)
    facts = GgufFacts(architecture="llama", file_size=4_900_000_000, block_count=32, head_count=32, head_count_kv=[8],
                      key_length=128, value_length=128, embedding_length=4096, context_length=131072)
    cpu_est, gpu_est = (profile_estimate(facts, m, p) for p in (cpu, gpu))
    assert cpu_est.ctx == 4096
    assert round(cpu_est.kv / 2**30, 2) == 0.5  # 32 layers x 8 heads x 256 values x 2 B x 4096 cells
    assert gpu_est.ctx == 131072
    sized = effective_model(m, {"http://m/m.gguf": facts}).profiles[0].min_memory_gb
    assert sized < 6  # 4.9 GB of weights + 0.54 GB of KV + 0.3 GB: an 8 GB node fits it (before: 22.3)
