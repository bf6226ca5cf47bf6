"""Expert packs of a mixed recipe: each MoE layer's role types and sizes recorded, every object one
contiguous 4 KiB-aligned read, resumable builds, verify, and streamed generation equal to resident."""

from __future__ import annotations

import json
import re

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

import k3stream
from k3stream import LoadOptions
from k3stream.pack import format as fmt
from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.pack.verify import verify_pack
from k3stream.store import ExpertStore
from pack_helpers import copy_model, read_index
from test_pack_resume import PACK, run_pack

DYNAMIC = dict(recipe="dynamic", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
MIB = 1 << 20


@pytest.fixture(scope="module")
def dynamic_pack(tiny_model, tmp_path_factory):
    """(GGUF path, manifest path) of the dynamic recipe, packed."""
    out = tmp_path_factory.mktemp("mixed")
    gguf = copy_model(tiny_model(**DYNAMIC), out)
    result = build_pack(gguf, out / "mixed.pack", out / "mixed.manifest.json")
    return gguf, result.manifest


def expert_tensors(gguf) -> dict[str, object]:
    return {t.name: t for t in GGUFReader(gguf).tensors if "_exps." in t.name}


def test_each_layer_records_its_role_types_and_sizes(dynamic_pack):
    gguf, manifest_path = dynamic_pack
    tensors = expert_tensors(gguf)
    section = json.loads(manifest_path.read_text())["expert_pack"]
    layer_types = set()
    for record in section["layers"]:
        for role, summary in record["roles"].items():
            tensor = tensors[f"blk.{record['layer']}.ffn_{role}_exps.weight"]
            assert summary["dtype"] == tensor.tensor_type.name and summary["dtype_id"] == int(
                tensor.tensor_type
            )
            assert summary["expert_bytes"] * section["num_experts"] == int(tensor.n_bytes)
        layer_types.add(tuple(record["roles"][role]["dtype"] for role in fmt.ROLES))
    assert len(layer_types) == len(section["layers"]) > 1  # the recipe gives every MoE layer other types
    assert section["object_bytes"] == max(record["object_bytes"] for record in section["layers"])


def test_every_object_is_one_aligned_contiguous_read_of_the_gguf_bytes(dynamic_pack):
    gguf, manifest_path = dynamic_pack
    tensors = expert_tensors(gguf)
    with ExpertPack(manifest_path) as pack:
        _, index = read_index(pack.path)
        for layer in pack.moe_layers:
            for expert in (0, pack.num_experts - 1):
                offset, nbytes = pack.object_range(layer, expert)
                assert offset % fmt.ALIGNMENT == 0
                data = pack.read_object(layer, expert)
                for role, part in pack.role_slices(layer, expert).items():
                    tensor = tensors[f"blk.{layer}.ffn_{role}_exps.weight"]
                    assert part.ggml_type == int(tensor.tensor_type) and part.offset % fmt.ALIGNMENT == 0
                    assert offset <= part.offset and part.offset + part.nbytes <= offset + nbytes
                    per_expert = tensor.data.reshape(pack.num_experts, -1)[expert].tobytes()
                    assert (
                        bytes(data[part.offset - offset : part.offset - offset + part.nbytes]) == per_expert
                    )
        assert sum(entry[4] for entry in index) == sum(int(t.n_bytes) for t in tensors.values())
    assert verify_pack(manifest_path, full=True)["ok"]


def test_a_killed_mixed_build_resumes_to_the_same_bytes(tiny_model, tmp_path, dynamic_pack):
    gguf = copy_model(tiny_model(**DYNAMIC), tmp_path)
    assert run_pack(gguf, kill_at="entry:100").returncode == -9
    resumed = run_pack(gguf)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"^resumed\s+[1-9]\d* bytes$", resumed.stdout, re.M)
    assert (tmp_path / PACK).read_bytes() == ExpertPack(dynamic_pack[1]).path.read_bytes()
    assert verify_pack(tmp_path / f"{PACK}.manifest.json", full=True)["ok"]


def test_a_role_summary_whose_type_disagrees_with_the_gguf_names_the_tensor(dynamic_pack, tmp_path):
    """The summary `expert_pack.roles` (the first MoE layer's types) recorded as another supported type:
    refused naming the tensor and both types, not as an unsupported type."""
    _, manifest_path = dynamic_pack
    manifest = json.loads(manifest_path.read_text())
    summary = manifest["expert_pack"]["roles"]["gate"]
    actual = summary["dtype"]
    other = "IQ2_XXS" if actual != "IQ2_XXS" else "IQ1_S"
    summary["dtype"], summary["dtype_id"] = other, int(GGMLQuantizationType[other])
    tampered = tmp_path / "tampered.manifest.json"
    tampered.write_text(json.dumps(manifest))
    message = f"Kimi expert-pack gate role is recorded as {other} ({summary['dtype_id']}), its GGUF tensor "
    message += f"blk.1.ffn_gate_exps.weight is {actual}"
    for open_pack in (ExpertPack, verify_pack):
        with pytest.raises(ValueError, match=re.escape(message)):
            open_pack(tampered)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("dtype", "IQ2_XS"),
            "layer 2 role gate is recorded as IQ2_XS (16), its GGUF tensor blk.2.ffn_gate_exps",
        ),
        (("expert_bytes", 4096), "layer 2 role gate is recorded as 4096 bytes per expert"),
    ],
)
def test_recorded_types_that_disagree_with_the_gguf_are_refused(dynamic_pack, tmp_path, change, message):
    _, manifest_path = dynamic_pack
    manifest = json.loads(manifest_path.read_text())
    record = next(r for r in manifest["expert_pack"]["layers"] if r["layer"] == 2)
    record["roles"]["gate"][change[0]] = change[1]
    tampered = tmp_path / "tampered.manifest.json"
    tampered.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=re.escape(message)):
        ExpertPack(tampered)
    with pytest.raises(ValueError, match=re.escape(message)):
        verify_pack(tampered)


@pytest.mark.parametrize("recorded", [-5, 4096])
def test_a_layer_object_size_that_disagrees_with_its_roles_is_refused(dynamic_pack, tmp_path, recorded):
    """A layer's `object_bytes` is what its roles add up to (aligned); another value was accepted (verify
    said OK)."""
    _, manifest_path = dynamic_pack
    manifest = json.loads(manifest_path.read_text())
    record = next(r for r in manifest["expert_pack"]["layers"] if r["layer"] == 2)
    actual, record["object_bytes"] = record["object_bytes"], recorded
    tampered = tmp_path / "tampered.manifest.json"
    tampered.write_text(json.dumps(manifest))
    message = f"Kimi expert-pack layer 2 is recorded as {recorded} bytes per object, its roles make {actual}"
    for check in (ExpertPack, verify_pack):
        with pytest.raises(ValueError) as caught:
            check(tampered)
        assert str(caught.value) == message


def test_one_recipe_for_every_layer_records_no_layers(tiny_model, tmp_path):
    gguf = copy_model(
        tiny_model(recipe="iq2_xxs", latent=256, expert_ff=256, kv_lora=256, qk_nope=32), tmp_path
    )
    result = build_pack(gguf, tmp_path / "one.pack", tmp_path / "one.manifest.json")
    assert "layers" not in json.loads(result.manifest.read_text())["expert_pack"]
    assert verify_pack(result.manifest)["ok"]


def greedy(model, prompt: list[int], count: int) -> tuple[list[int], torch.Tensor]:
    state = model.new_state()
    logits = model.prefill(state, prompt)[-1]
    tokens, rows = [], []
    for _ in range(count):
        tokens.append(int(logits.argmax()))
        logits = model.decode(state, tokens[-1])
        rows.append(logits)
    return tokens, torch.stack(rows)


def test_streamed_greedy_generation_equals_the_resident_load(dynamic_pack):
    gguf, manifest_path = dynamic_pack
    prompt = [5, 17, 3, 99, 42]
    expected_tokens, expected_logits = greedy(k3stream.load(gguf), prompt, 8)
    with ExpertPack(manifest_path) as pack:
        slots = pack.top_k + 2
        with ExpertStore(pack, ram_mib=slots * pack.object_bytes / MIB) as store:
            tokens, logits = greedy(k3stream.load(gguf, LoadOptions(expert_source=store)), prompt, 8)
            assert store.stats()["pack_reads"] > 0
    assert tokens == expected_tokens
    assert torch.equal(logits, expected_logits)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ("not a list", "Kimi expert-pack layers do not list its MoE layers"),
        ([], "Kimi expert-pack layers do not list its MoE layers"),
        ([{"layer": 1}], "Kimi expert-pack layers do not list its MoE layers"),
        ("drop roles", "Kimi expert-pack layer 1 role up is recorded as None (None)"),
    ],
)
def test_malformed_layer_records_fail_in_one_line(dynamic_pack, tmp_path, layers, message):
    _, manifest_path = dynamic_pack
    manifest = json.loads(manifest_path.read_text())
    if layers == "drop roles":
        del manifest["expert_pack"]["layers"][0]["roles"]
    else:
        manifest["expert_pack"]["layers"] = layers
    tampered = tmp_path / "tampered.manifest.json"
    tampered.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        verify_pack(tampered)
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_generate_chat_and_serve_stream_the_dynamic_recipe(dynamic_pack, tmp_path):
    """The commands on the packed dynamic recipe, experts streamed from the pack in a budget of a few
    objects: `generate` and `chat` print the library's greedy text of the resident GGUF, and `serve`
    answers the openai client's completion (127.0.0.1) with the same text. ggml's arithmetic, named
    on both sides (the commands' default and the library's need not be the same)."""
    import openai

    from k3stream.engine.chat import ChatTemplate
    from k3stream.engine.generate import SamplingParams, generate
    from k3stream.engine.tokenizer import Tokenizer
    from k3stream.server.live import ServerProcess
    from test_generate import _cli

    gguf, manifest = dynamic_pack
    model, tokenizer = k3stream.load(gguf, LoadOptions(match_ggml=True)), Tokenizer.from_gguf(gguf)
    prompt, turn = "The capital of France is", [{"role": "user", "content": "Hello"}]
    expected = generate(
        model, tokenizer, tokenizer.encode(prompt), SamplingParams(temperature=0, max_tokens=8)
    )
    reply_ids = tokenizer.encode(ChatTemplate.for_tokenizer(tokenizer).render(turn), allow_special=True)
    reply = generate(model, tokenizer, reply_ids, SamplingParams(temperature=0, max_tokens=5))
    assert expected.text and reply.text
    with ExpertPack(manifest) as pack:
        flags = ["--match-ggml", "--ram-mib", f"{(pack.top_k + 2) * pack.object_bytes / MIB:.3f}"]
    done = _cli(
        "generate", str(manifest), "--prompt", prompt, "--temperature", "0", "--max-tokens", "8", *flags
    )
    assert done.returncode == 0 and done.stdout == expected.text + "\n", done.stderr
    done = _cli(
        "chat", str(manifest), "--temperature", "0", "--max-tokens", "5", "--quiet", *flags, stdin="Hello\n"
    )
    assert done.returncode == 0 and done.stdout == reply.text + "\n", done.stderr
    with ServerProcess(manifest, *flags, log_path=tmp_path / "serve.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        answer = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    assert answer.choices[0].text == expected.text
