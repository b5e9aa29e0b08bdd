"""Refusals read as one plain sentence that names the file and the field (or the option) at fault."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import TINY
from inkling_ckpt.errors import InklingError
from inkling_ckpt.layouts.hf import HFCheckpoint


def _edit_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_quantization_config_names_file_and_fields(tmp_path):
    bad = _edit_config(TINY["mxfp8"], tmp_path / "m", lambda c: c["quantization_config"].update(weight_block_size=[128, 128]))
    with pytest.raises(InklingError) as e:
        HFCheckpoint.open(bad)
    assert str(e.value) == (f"{bad}/config.json: quantization_config.weight_block_size is [128, 128] and "
                            "quantization_config.scale_fmt is 'ue8m0'; MXFP8 experts need [1, 32] and 'ue8m0' "
                            "(transformers would misread the scales)")


def test_impossible_config_value_names_both_fields_and_values(tmp_path):
    bad = _edit_config(TINY["bf16"], tmp_path / "b", lambda c: c["text_config"].update(num_experts_per_tok=9))
    with pytest.raises(InklingError) as e:
        HFCheckpoint.open(bad)
    assert str(e.value) == (f"{bad / 'config.json'}: text_config.num_experts_per_tok is 9, more than "
                            "text_config.n_routed_experts (8)")


def test_bad_option_values_read_as_sentences(cli, tmp_path):
    code, _, err = cli("convert", "megatron-to-hf", tmp_path / "none", tmp_path / "o", "--reference", TINY["mixed"],
                       "--scales", "bogus")
    assert code == 2 and "Invalid value for '--scales': 'bogus' is not one of 'fresh', 'keep'" in _one_line(err)
    code, _, err = cli("memory", tmp_path / "nothing-here", "--tp", "1")
    assert code != 0 and f"{tmp_path / 'nothing-here'} is neither a checkpoint folder nor a config.json" in _one_line(err)
