"""Pooling configuration as sentence-transformers saves it, and pooling over packed sequences."""
import json

import pytest
import torch

from models.pooling import PoolingConfig, pool, read_pooling_config

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def write_st_dir(root, pooling_config: dict | None, normalize: bool, max_seq_length: int | None = None,
                 pooling_path: str = "1_Pooling", pooling_type: str = "sentence_transformers.models.Pooling"):
    modules = [TRANSFORMER]
    if pooling_config is not None:
        modules.append({"idx": 1, "name": "1", "path": pooling_path, "type": pooling_type})
        (root / pooling_path).mkdir()
        (root / pooling_path / "config.json").write_text(json.dumps(pooling_config))
    if normalize:
        modules.append(NORMALIZE)
    (root / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None:
        (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return str(root)


def legacy_flags(**on):
    flags = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
             "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
             "pooling_mode_lasttoken": False}
    return {"word_embedding_dimension": 8, **flags, **{f"pooling_mode_{k}": v for k, v in on.items()}}


@pytest.mark.parametrize("flag, mode", [("mean_tokens", "mean"), ("cls_token", "cls"), ("lasttoken", "last")])
@pytest.mark.parametrize("normalize", [True, False])
def test_legacy_flags_and_normalize(tmp_path, flag, mode, normalize):
    model_dir = write_st_dir(tmp_path, legacy_flags(**{flag: True}), normalize, max_seq_length=128)
    assert read_pooling_config(model_dir, "cls" if mode != "cls" else "mean") == PoolingConfig(mode, normalize, 128)


@pytest.mark.parametrize("name, mode",
                         [("mean", "mean"), ("cls", "cls"), ("lasttoken", "last"), (["lasttoken"], "last")])
def test_pooling_mode_key_of_newer_versions(tmp_path, name, mode):
    model_dir = write_st_dir(tmp_path, {"embedding_dimension": 8, "pooling_mode": name, "include_prompt": True},
                             normalize=False, pooling_type="sentence_transformers.sentence_transformer.modules.Pooling")
    assert read_pooling_config(model_dir, "mean") == PoolingConfig(mode, False, None)


def test_pooling_folder_comes_from_modules_json(tmp_path):
    model_dir = write_st_dir(tmp_path, legacy_flags(cls_token=True), normalize=True, pooling_path="pool_here")
    assert read_pooling_config(model_dir, "mean").mode == "cls"


def test_plain_transformers_dir_uses_default_normalised(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert read_pooling_config(str(tmp_path), "last") == PoolingConfig("last", True, None)


def test_no_pooling_module_uses_default(tmp_path):
    model_dir = write_st_dir(tmp_path, None, normalize=False, max_seq_length=64)
    assert read_pooling_config(model_dir, "cls") == PoolingConfig("cls", False, 64)


@pytest.mark.parametrize("config", [legacy_flags(max_tokens=True), legacy_flags(mean_tokens=True, cls_token=True),
                                    legacy_flags(), {"pooling_mode": "weightedmean"}])
def test_unsupported_pooling_is_refused_by_name(tmp_path, config):
    with pytest.raises(ValueError, match="pooling"):
        read_pooling_config(write_st_dir(tmp_path, config, normalize=True), "mean")


def test_missing_pooling_config_file_is_named(tmp_path):
    model_dir = write_st_dir(tmp_path, legacy_flags(mean_tokens=True), normalize=True)
    (tmp_path / "1_Pooling" / "config.json").unlink()
    with pytest.raises(ValueError, match="1_Pooling"):
        read_pooling_config(model_dir, "mean")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_matches_per_sequence_reference(dtype):
    torch.manual_seed(0)
    lengths = [1, 7, 3, 64, 2]
    hidden = torch.randn(sum(lengths), 16).to(dtype)
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    pieces = hidden.float().split(lengths)
    expected = {"mean": torch.stack([p.mean(0) for p in pieces]),
                "cls": torch.stack([p[0] for p in pieces]),
                "last": torch.stack([p[-1] for p in pieces])}
    for mode, want in expected.items():
        got = pool(hidden, cu_seqlens, mode)
        assert got.dtype == torch.float32 and got.shape == (len(lengths), 16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pool_rejects_unknown_mode():
    with pytest.raises(ValueError, match="max"):
        pool(torch.zeros(2, 4), torch.tensor([0, 2], dtype=torch.int32), "max")


def test_modules_we_do_not_implement_are_refused_by_name(tmp_path):
    model_dir = write_st_dir(tmp_path, legacy_flags(mean_tokens=True), normalize=True)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        read_pooling_config(model_dir, "mean")
