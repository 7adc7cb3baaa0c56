"""minagi/export.py: a checkpoint exported as model.safetensors + config.json + vocab.json writes the same text
and scores the same loss as the checkpoint (trainable and frozen NF4 experts); skipped without safetensors,
whose absence is one line."""
import json
import sys

import pytest
import torch

from minagi import sample as sample_py
from minagi import export
from minagi.checkpoint import Checkpoint, CheckpointError
from minagi.loading import load_trained
from tiny import run_tiny

FROZEN = ["experts.frozen=true", "experts.blocksize=32", "experts.double_quant=true"]


@pytest.fixture(scope="module", params=["trainable", "frozen-nf4"])
def run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    return run_tiny(tmp, None, *(FROZEN if request.param == "frozen-nf4" else [])).run_dir


def _greedy(path, capsys) -> str:
    assert sample_py.main([str(path), "--prompt", "the ", "--chars", "60", "--temperature", "0", "--no-echo"]) == 0
    return capsys.readouterr().out


def test_the_export_writes_the_checkpoints_greedy_text(run, tmp_path, capsys):
    pytest.importorskip("safetensors")
    out = tmp_path / "shared"
    assert export.main([str(run), str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"exported {run / 'best.pt'} (step ") and str(out) in said
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "vocab.json"]
    text = _greedy(run, capsys)
    assert len(text) == 60 and _greedy(out, capsys) == text
    sampled = ["--prompt", "the ", "--chars", "40", "--seed", "3", "--top-k", "5", "--no-echo"]
    assert sample_py.main([str(run), *sampled]) == 0
    at_temperature = capsys.readouterr().out
    assert sample_py.main([str(out), *sampled]) == 0 and capsys.readouterr().out == at_temperature


def test_the_export_holds_the_state_dict_as_stored_and_names_the_nf4_layout(run, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    meta = export.export_model(run / "last.pt", tmp_path / "out")
    ckpt = Checkpoint.load(run / "last.pt")
    tensors = st.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert tensors.keys() == ckpt.model.keys()
    assert all(torch.equal(tensors[k], ckpt.model[k]) and tensors[k].dtype == ckpt.model[k].dtype for k in tensors)
    on_disk = json.loads((tmp_path / "out" / "config.json").read_text())
    assert on_disk == json.loads(json.dumps(meta)) and meta["format"] == "minagi-export" and meta["step"] == ckpt.step
    assert meta["vocab_size"] == ckpt.vocab.size and meta["config"]["model"]["d_model"] == 32
    vocab = json.loads((tmp_path / "out" / "vocab.json").read_text())
    assert "".join(sorted(vocab, key=vocab.get)) == ckpt.vocab.chars and sorted(vocab.values()) == list(range(len(vocab)))
    if ckpt.config.experts.frozen:
        stacks = meta["frozen_stacks"]["stacks"]
        assert set(stacks) == {"rows.0.mlp.experts.gate_up", "rows.0.mlp.experts.down"}
        gate_up = stacks["rows.0.mlp.experts.gate_up"]
        assert gate_up["shape"] == [4, 32, 64] and gate_up["blocksize"] == 32 and gate_up["double_quant"]
        assert "high nibble" in gate_up["layout"] and len(meta["frozen_stacks"]["nf4_table"]) == 16
        assert tensors["rows.0.mlp.experts.gate_up.packed"].dtype == torch.uint8  # packed bytes, not dequantized
        assert set(gate_up["tensors"]) <= set(tensors)
    else:
        assert meta["frozen_stacks"] == {}


def test_evaluate_scores_the_export_as_the_checkpoint(run, tmp_path, capsys):
    pytest.importorskip("safetensors")
    from minagi import evaluate
    export.export_model(run / "best.pt", tmp_path / "out")
    text = tmp_path / "t.txt"
    text.write_text("000 the quick brown fox jumps over the lazy dog.\n" * 3)
    reports = []
    for source in (run / "best.pt", tmp_path / "out"):
        assert evaluate.main([str(source), "--data", str(text), "--json", str(tmp_path / "e.json")]) == 0
        reports.append(json.loads((tmp_path / "e.json").read_text())["overall"])
    capsys.readouterr()
    assert reports[0]["nats_sum"] == pytest.approx(reports[1]["nats_sum"], rel=1e-6)


def test_an_existing_export_is_not_overwritten(run, tmp_path, capsys):
    pytest.importorskip("safetensors")
    assert export.main([str(run), str(tmp_path / "out")]) == 0
    assert export.main([str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds model.safetensors, config.json, vocab.json" in err[0]


def test_without_safetensors_exporting_and_reading_are_one_line_errors(run, tmp_path, monkeypatch, capsys):
    if _has_safetensors():  # an export to read, then the package hidden
        export.export_model(run / "best.pt", tmp_path / "out")
    else:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "model.safetensors").write_bytes(b"")
        (tmp_path / "out" / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert export.main([str(run), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install safetensors" in err[0]
    with pytest.raises(CheckpointError, match="pip install safetensors"):
        load_trained(tmp_path / "out")
    assert sample_py.main([str(tmp_path / "out")]) == 2


def _has_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def _by_hand(folder, ids: dict, format_version: int = export.FORMAT_VERSION):
    """An export folder written without a run: a config, `ids` as vocab.json, one tensor as the model."""
    st = pytest.importorskip("safetensors.torch")
    from minagi.config import config_to_dict, load_config
    folder.mkdir()
    meta = {"format": export.FORMAT, "format_version": format_version, "config": config_to_dict(load_config(None))}
    (folder / "config.json").write_text(json.dumps(meta))
    (folder / "vocab.json").write_text(json.dumps(ids))
    st.save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return folder


def test_vocab_json_is_read_by_id_whatever_the_order_of_its_keys(tmp_path):
    assert export.read_export(_by_hand(tmp_path / "out", {"c": 2, "a": 0, "b": 1})).vocab.chars == "abc"


@pytest.mark.parametrize("ids,why", [({"a": 0, "b": 2}, "ids are not 0..V-1"), ({"a": 1, "b": 0}, r"sorted .*'ba'"),
                                     ({"a": 1, "b": 2}, "ids are not 0..V-1")])
def test_a_vocab_json_whose_ids_are_not_the_sorted_characters_0_to_v_1_is_refused_naming_the_export(tmp_path, ids, why):
    """Ids with a gap, or out of the characters' order, would give the model's rows to the wrong characters."""
    folder = _by_hand(tmp_path / "out", ids)
    with pytest.raises(CheckpointError, match=why) as err:
        export.read_export(folder)
    assert str(err.value).startswith(f"{folder}: not a usable export (") and "\n" not in str(err.value)


def test_an_export_of_a_newer_format_version_is_refused_naming_it(tmp_path):
    folder = _by_hand(tmp_path / "out", {"a": 0, "b": 1}, export.FORMAT_VERSION + 1)
    with pytest.raises(CheckpointError, match=f"export format_version {export.FORMAT_VERSION + 1} is newer") as err:
        export.read_export(folder)
    assert str(err.value).startswith(f"{folder}: ")
    assert export.read_export(_by_hand(tmp_path / "now", {"a": 0, "b": 1})).vocab.chars == "ab"
