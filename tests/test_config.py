"""minagi.config: strict loading, precedence, round trips, and the shipped profiles."""

import dataclasses
import json
import tomllib
import warnings
from pathlib import Path

import pytest

from minagi.config import (
    PROFILES_DIR, Config, ConfigError, ConfigNote, DataConfig, MemoryConfig, ModelConfig, PoolConfig,
    TrainConfig, apply_overrides, available_profiles, config_from_dict, config_to_dict, load_config,
    resolve_profile, upgrade_config_dict)

SHIPPED = sorted(PROFILES_DIR.glob("*.toml"))
SECTION_NAMES = "data, experts, memory, model, pool, train"


def profile_description(name: str) -> str:
    return tomllib.loads(resolve_profile(name).read_text(encoding="utf-8")).get("description", "")


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def config_to_toml(cfg: Config, description: str = "") -> str:
    """The whole resolved config as a TOML profile."""
    lines = [f"description = {toml_value(description)}"] if description else []
    for section, table in config_to_dict(cfg).items():
        lines += ["", f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


@pytest.fixture(autouse=True)
def _run_from_the_repo_root(monkeypatch):
    """Messages name a file relative to the working directory when under it; pin that."""
    monkeypatch.chdir(PROFILES_DIR.parent)


def write(tmp_path: Path, text: str, name: str = "foo.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(fn, *args) -> str:
    """Run fn, expect a ConfigError, and check the message is one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    return message


# --- the dataclasses ------------------------------------------------------------------------


def test_defaults_match_the_contract_and_are_valid():
    cfg = load_config(None)
    assert cfg == Config()
    model = cfg.model
    assert (model.n_rows, model.d_model, model.n_heads, model.context) == (2, 64, 4, 64)
    assert (cfg.pool.n_experts, cfg.pool.top_k, cfg.pool.d_expert) == (8, 2, 64)
    assert cfg.pool.capacity_factor == 0.0 and cfg.pool.dispatch == "auto"
    train = cfg.train
    assert (train.steps, train.batch_size, train.lr, train.warmup_steps) == (300, 16, 3e-3, 30)
    assert cfg.train.device == "auto" and cfg.train.out_dir == "runs" and cfg.train.run_name == ""
    assert cfg.data == DataConfig(path="", heldout_fraction=0.1, cache_dir="")
    assert cfg.memory.alloc_conf == ""
    assert cfg.model.head_dim == 16


@pytest.mark.parametrize("cls", [ModelConfig, PoolConfig, DataConfig, TrainConfig, MemoryConfig, Config])
def test_components_are_frozen_and_keyword_only(cls):
    obj = cls()
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, getattr(obj, field))
    with pytest.raises(TypeError):
        cls(getattr(obj, field))  # positional


def test_direct_construction_validates_too():
    assert "pool.top_k" in error_of(lambda: PoolConfig(n_experts=2, top_k=3))
    assert "expected an integer, got a boolean" in error_of(lambda: TrainConfig(steps=True))
    assert "not one of" in error_of(lambda: TrainConfig(device="tpu"))
    assert "config.model" in error_of(lambda: Config(model={"n_rows": 2}))


# --- rejections from a profile file ---------------------------------------------------------


def test_unknown_section_is_rejected_listing_the_valid_sections(tmp_path):
    path = write(tmp_path, "[modle]\nn_rows = 2\n")
    assert error_of(load_config, str(path)) == (
        f"{path}: unknown section '[modle]' (valid: {SECTION_NAMES}); "
        "did you mean 'model'?")


def test_top_level_key_outside_a_section_is_rejected_pointing_at_its_section(tmp_path):
    msg = error_of(load_config, str(write(tmp_path, "steps = 10\n")))
    assert "foo.toml" in msg and "unknown top-level key 'steps'" in msg and "'train.steps'" in msg


def test_unknown_key_is_rejected_with_the_valid_keys_listed(tmp_path):
    msg = error_of(load_config, str(write(tmp_path, "[pool]\nn_expert = 4\n")))
    assert "foo.toml: unknown key 'pool.n_expert' (valid: " in msg
    valid = [f.name for f in dataclasses.fields(PoolConfig)]
    assert all(name in msg for name in valid)
    assert "did you mean 'n_experts'" in msg


def test_a_pool_key_under_model_points_at_its_section(tmp_path):
    # Profiles written before [pool] existed set these under [model].
    msg = error_of(load_config, str(write(tmp_path, "[model]\nn_experts = 4\n")))
    assert "unknown key 'model.n_experts'" in msg and "it belongs under [pool]: pool.n_experts" in msg
    msg = error_of(load_config, None, ["model.top_k=4"])
    assert msg.startswith("--set model.top_k: unknown key") and "pool.top_k" in msg


def test_nested_table_inside_a_section_is_an_unknown_key(tmp_path):
    msg = error_of(load_config, str(write(tmp_path, "[model.extra]\nx = 1\n")))
    assert "unknown key 'model.extra'" in msg


@pytest.mark.parametrize("text, key, expected", [
    ('[pool]\ntop_k = "2"\n', "pool.top_k", "expected an integer, got a string"),
    ("[pool]\ntop_k = true\n", "pool.top_k", "expected an integer, got a boolean"),
    ("[pool]\ntop_k = 2.0\n", "pool.top_k", "expected an integer, got a float"),
    ("[train]\nlr = true\n", "train.lr", "expected a float, got a boolean"),
    ("[train]\ncompile = 1\n", "train.compile", "train.compile = 1 is not one of: true, false, \"rows\""),
    ("[train]\ncheckpoint_rows = 1\n", "train.checkpoint_rows", "expected a boolean, got an integer"),
    ("[data]\npath = 3\n", "data.path", "expected a string, got an integer"),
    ('[data]\nheldout_files = "a.txt"\n', "data.heldout_files", "expected an array of strings, got a string"),
    ("[data]\nheldout_files = [1]\n", "data.heldout_files", "expected an array of strings, got an array"),
    ("[train]\nsteps = [1, 2]\n", "train.steps", "expected an integer, got an array"),
    ("model = 3\n", "model", "must be a table [model]"),
    ("description = 3\n", "description", "expected a string"),
])
def test_wrong_type_is_rejected_naming_file_and_key(tmp_path, text, key, expected):
    msg = error_of(load_config, str(write(tmp_path, text)))
    assert "foo.toml: " in msg and key in msg and expected in msg


def test_int_for_a_float_field_is_accepted_and_stored_as_float(tmp_path):
    cfg = load_config(str(write(tmp_path, "[train]\nlr = 1\n[pool]\ncapacity_factor = 2\n")))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert isinstance(cfg.pool.capacity_factor, float)


def test_value_outside_a_literal_is_rejected_listing_the_choices(tmp_path):
    path = write(tmp_path, '[pool]\ndispatch = "fast"\n')
    assert error_of(load_config, str(path)) == (
        f'{path}: pool.dispatch = "fast" is not one of: auto, grouped, native, triton, rectangle, loop')


def test_top_k_above_n_experts_is_impossible(tmp_path):
    path = write(tmp_path, "[pool]\ntop_k = 9\n")
    assert error_of(load_config, str(path)) == (
        f"{path}: pool.top_k = 9 is impossible: top_k must be <= n_experts (8)")


def test_a_rule_broken_by_a_default_the_file_does_not_set_says_so(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 20\n")  # the default warm-up, 30 steps, is longer
    assert error_of(load_config, str(path)) == (
        f"{path}: train.warmup_steps = 30 is impossible: warmup_steps must be <= steps (20) "
        f"(train.warmup_steps is the default: {path} does not set it)")


def test_a_profile_under_the_working_directory_is_named_by_its_relative_path(tmp_path, monkeypatch):
    (tmp_path / "profiles").mkdir()
    write(tmp_path / "profiles", "[pool]\nn_expert = 4\n")
    monkeypatch.chdir(tmp_path)
    msg = error_of(load_config, "profiles/foo.toml")
    assert msg.startswith("profiles/foo.toml: unknown key 'pool.n_expert' (valid: aux_free_bias, ")


@pytest.mark.parametrize("section, key, value, why", [
    ("model", "n_rows", "0", "must be >= 1"),
    ("model", "d_model", "66", "multiple of n_heads"),
    ("model", "d_model", "68", "must be even"),         # 68 / 4 = 17
    ("pool", "capacity_factor", "-0.5", "must be >= 0"),
    ("pool", "sink_ratio", "0", "must be > 0"),
    ("pool", "shared_experts", "-1", "must be >= 0"),
    ("model", "d_dense", "-1", "must be >= 0"),
    ("model", "rope_base", "0", "must be > 0"),
    ("data", "heldout_fraction", "0", "strictly between 0 and 1"),
    ("data", "heldout_fraction", "1.0", "strictly between 0 and 1"),
    ("train", "warmup_steps", "301", "warmup_steps must be <= steps (300)"),
    ("train", "eval_every", "0", "must be >= 1"),
    ("train", "lr", "nan", "finite"),
    ("train", "lr", "0", "must be > 0"),
    ("train", "beta2", "1.0", "[0, 1)"),
    ("train", "min_lr_ratio", "1.5", "between 0 and 1"),
    ("train", "min_lr_ratio", "-0.1", "between 0 and 1"),
    ("model", "dropout", "1.0", "[0, 1)"),
    ("pool", "expert_dropout", "1.0", "[0, 1)"),
    ("train", "run_name", '"a/b"', "plain folder name"),
    ("train", "out_dir", '""', "must name a folder"),
    ("memory", "alloc_conf", '"expandable_segments"', "name:value pairs"),
])
def test_impossible_values_are_rejected_naming_the_key(tmp_path, section, key, value, why):
    msg = error_of(load_config, str(write(tmp_path, f"[{section}]\n{key} = {value}\n")))
    assert f"foo.toml: {section}.{key} = " in msg and "is impossible" in msg and why in msg


@pytest.mark.parametrize("compile_, setting, why", [
    ('"rows"', "checkpoint_rows = true", "recompute cannot replay them"),
    ('"rows"', "accum_steps = 2", "overwritten by the next micro-batch's replay"),
    ("true", "accum_steps = 2", "overwritten by the next micro-batch's replay")])
def test_cuda_graphs_are_refused_when_a_run_is_built_but_a_stored_config_with_them_loads(tmp_path, compile_, setting,
                                                                                         why):
    from minagi.config import check_cuda_graphs
    toml = f'[train]\ncompile = {compile_}\ncompile_mode = "reduce-overhead"\n{setting}\n'
    cfg = load_config(str(write(tmp_path, toml)))  # a run folder saved with it still loads (sample.py, --resume)
    assert config_from_dict(dataclasses.asdict(cfg)).train == cfg.train
    msg = error_of(check_cuda_graphs, cfg.train)
    assert msg.startswith('train.compile_mode = "reduce-overhead" is impossible: with CUDA graphs') and why in msg
    assert "\n" not in msg and 'use train.compile_mode = "default" with train.' + setting.replace(" = ", " = ") in msg
    check_cuda_graphs(load_config(str(write(tmp_path, toml.replace('"reduce-overhead"', '"default"')))).train)
    check_cuda_graphs(load_config(str(write(tmp_path, toml.replace(setting, "")))).train)


@pytest.mark.parametrize("compile_, setting", [('"rows"', "checkpoint_rows = true"), ("true", "accum_steps = 2")])
def test_the_cudagraphs_backend_is_refused_where_cuda_graphs_are_naming_its_own_key(tmp_path, compile_, setting):
    from minagi.config import check_cuda_graphs
    toml = f'[train]\ncompile = {compile_}\ncompile_backend = "cudagraphs"\n{setting}\n'
    msg = error_of(check_cuda_graphs, load_config(str(write(tmp_path, toml))).train)
    assert msg.startswith('train.compile_backend = "cudagraphs" is impossible: with CUDA graphs') and "\n" not in msg
    assert f'use train.compile_backend = "inductor" (it needs Triton) or train.compile = false with train.{setting}' in msg
    check_cuda_graphs(load_config(str(write(tmp_path, toml.replace(setting, "")))).train)


def test_a_compile_mode_beside_the_cudagraphs_backend_is_refused_in_one_line(tmp_path):
    toml = '[train]\ncompile = "rows"\ncompile_backend = "cudagraphs"\ncompile_mode = "reduce-overhead"\n'
    msg = error_of(load_config, str(write(tmp_path, toml)))
    assert 'train.compile_mode = "reduce-overhead" is impossible: a mode is inductor\'s' in msg and "\n" not in msg
    assert load_config(str(write(tmp_path, toml.replace('"reduce-overhead"', '"default"')))).train.compile_backend \
        == "cudagraphs"


def test_invalid_toml_names_the_file_and_line(tmp_path):
    msg = error_of(load_config, str(write(tmp_path, "[model]\nn_rows = = 2\n")))
    assert "foo.toml: invalid TOML: " in msg
    assert "line 2" in msg


def test_config_from_dict_is_strict_and_names_its_source():
    msg = error_of(config_from_dict, {"pool": {"n_expert": 4}}, "ckpt.pt")
    assert msg.startswith("ckpt.pt: unknown key 'pool.n_expert' (valid: ")
    assert error_of(config_from_dict, {"train": {"steps": True}}).startswith("<dict>: train.steps")


# --- --set overrides ------------------------------------------------------------------------


@pytest.mark.parametrize("item", ["train.steps", "steps=5", "a.b.c=1", "=5", ".x=1", "train.=1"])
def test_bad_set_syntax_is_rejected_with_an_example(item):
    msg = error_of(load_config, None, [item])
    assert msg.startswith("--set ") and "expected section.key=value" in msg


def test_unknown_set_key_and_section_are_rejected_listing_valid_names():
    msg = error_of(load_config, None, ["pool.n_expert=4"])
    assert msg.startswith("--set pool.n_expert: unknown key 'pool.n_expert' (valid: ")
    assert "n_experts" in msg
    msg = error_of(load_config, None, ["modle.n_rows=4"])
    assert "unknown section 'modle'" in msg and f"(valid: {SECTION_NAMES})" in msg


@pytest.mark.parametrize("item, expected", [
    ("pool.top_k=abc", "cannot read 'abc' as an integer"),
    ("pool.top_k=true", "expected an integer, got a boolean"),
    ("pool.top_k=9", "top_k must be <= n_experts (8)"),
    ("pool.dispatch=fast", "not one of: auto"),
    ("train.lr=1\nw = 2", "cannot read"),
])
def test_bad_set_value_is_rejected_naming_the_set(item, expected):
    key = item.split("=")[0]
    msg = error_of(load_config, None, [item])
    assert msg.startswith(f"--set {key}: ") and expected in msg


def test_set_parses_toml_values_and_bare_strings_for_string_fields_only():
    cfg = load_config(None, ["train.steps=20000", "train.lr=3e-4", "train.compile=true",
                             "data.path=~/my corpus/*.txt", 'train.run_name="quoted"',
                             "train.device=cpu", "train.out_dir=123", "pool.capacity_factor=2"])
    assert cfg.train.steps == 20000 and cfg.train.lr == 3e-4 and cfg.train.compile is True
    assert cfg.data.path == "~/my corpus/*.txt" and cfg.train.run_name == "quoted"
    assert cfg.train.device == "cpu" and cfg.train.out_dir == "123"
    assert cfg.pool.capacity_factor == 2.0


def test_set_beats_profile_beats_defaults(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 50\nwarmup_steps = 5\nlr = 1e-3\n")
    cfg = load_config(str(path), ["train.steps=70", "train.steps=80"])  # the later --set wins
    assert cfg.train.steps == 80                   # --set beats the profile
    assert cfg.train.lr == 1e-3                    # the profile beats the default
    assert cfg.train.batch_size == TrainConfig().batch_size  # untouched keys keep the default


def test_impossible_combination_is_blamed_on_the_set_that_made_it(tmp_path):
    path = write(tmp_path, "[pool]\nn_experts = 8\ntop_k = 4\n")
    msg = error_of(load_config, str(path), ["pool.n_experts=2", "train.steps=100"])
    assert msg == ("--set pool.n_experts: pool.top_k = 4 is impossible: "
                   "top_k must be <= n_experts (2)")


def test_an_impossible_combination_blames_the_set_of_a_key_of_its_rule_not_the_whole_section(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 500\nwarmup_steps = 50\n")
    # fit_warmup off (a resume, a library caller): train.steps below the warmup is refused, blaming train.steps.
    cfg = load_config(str(path))
    msg = error_of(apply_overrides, cfg, ["train.steps=40", "train.eval_every=10"])
    assert msg == "--set train.steps: train.warmup_steps = 50 is impossible: warmup_steps must be <= steps (40)"
    msg = error_of(load_config, str(path), ["train.warmup_steps=60", "train.steps=40", "train.eval_every=10"])
    assert msg == "--set train.warmup_steps: train.warmup_steps = 60 is impossible: warmup_steps must be <= steps (40)"


def test_a_set_of_train_steps_below_the_profiles_warmup_fits_the_warmup_and_says_so(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 500\nwarmup_steps = 50\n")
    with pytest.warns(ConfigNote, match=r"^train\.warmup_steps = 50 exceeds train\.steps = 40: warming up over "
                                        r"4 steps \(a tenth of them, at least one\) instead"):
        cfg = load_config(str(path), ["train.steps=40", "train.eval_every=10"])
    assert (cfg.train.steps, cfg.train.warmup_steps, cfg.train.eval_every) == (40, 4, 10)
    with pytest.warns(ConfigNote, match=r"warming up over 1 step \(a tenth of them, at least one\)"):
        assert load_config(str(path), ["train.steps=5", "train.eval_every=5"]).train.warmup_steps == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note when the warmup fits, or was set too
        assert load_config(str(path), ["train.steps=60"]).train.warmup_steps == 50
        assert load_config(str(path), ["train.steps=40", "train.warmup_steps=5"]).train.warmup_steps == 5
        with pytest.raises(ConfigError, match="lora_rank"):  # an unrelated error: said alone, no note before it
            load_config(str(path), ["train.steps=40", "experts.lora_rank=4"])


def test_apply_overrides_accepts_a_single_string():
    assert apply_overrides(Config(), "train.steps=70").train.steps == 70


# --- profiles -------------------------------------------------------------------------------


def test_missing_profile_lists_the_available_ones():
    msg = error_of(load_config, "no_such_profile")
    assert "unknown profile 'no_such_profile'" in msg
    assert all(name in msg for name in available_profiles())


def test_resolve_profile_takes_a_name_a_name_with_suffix_or_an_existing_path(tmp_path):
    assert resolve_profile("cpu_tiny") == PROFILES_DIR / "cpu_tiny.toml"
    assert resolve_profile("cpu_tiny.toml") == PROFILES_DIR / "cpu_tiny.toml"
    path = write(tmp_path, "[train]\nsteps = 5\nwarmup_steps = 0\n", name="mine.toml")
    assert resolve_profile(str(path)) == path
    assert load_config(str(path)).train.steps == 5
    assert resolve_profile(str(tmp_path / "mine")) == path  # a path's .toml may be left off, as a name's
    msg = error_of(resolve_profile, str(tmp_path / "yours"))
    assert msg.startswith(f"unknown profile '{tmp_path / 'yours'}': no such file, nor {tmp_path / 'yours.toml'} ")
    assert error_of(resolve_profile, "cpu_tny").endswith("; did you mean 'cpu_tiny'?")  # a typo of a name
    assert error_of(resolve_profile, str(tmp_path)).startswith(f"--profile {tmp_path}: a folder, not a profile")


def test_a_folder_here_named_as_a_profile_does_not_hide_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h200").mkdir()  # e.g. an out_dir named after the profile
    assert resolve_profile("h200") == PROFILES_DIR / "h200.toml"


def test_description_is_allowed_beside_the_sections(tmp_path):
    path = write(tmp_path, 'description = "a test box"\n[train]\nsteps = 40\n')
    assert load_config(str(path)).train.steps == 40


def test_config_round_trips_through_dict_and_toml():
    cfg = load_config(None, ["pool.n_experts=16", "pool.top_k=4", "train.lr=2.5e-4", 'data.heldout_files=["a.txt", "b c.txt"]',
                             "data.path=a \"quoted\"\tpath\u00e9", "pool.aux_free_bias=true",
                             "memory.alloc_conf=expandable_segments:True"])
    d = config_to_dict(cfg)
    assert config_from_dict(d) == cfg
    assert config_to_dict(config_from_dict(d)) == d
    text = config_to_toml(cfg, description="round trip")
    assert config_from_dict(tomllib.loads(text)) == cfg
    assert tomllib.loads(text)["description"] == "round trip"


def test_profiles_are_shipped():
    expected = {"cpu_tiny", "cuda_small", "strix_small", "strix_large", "h200"}
    assert expected <= set(available_profiles())


# Keys a profile sets on purpose although they equal the default (each explained in the file).
PINNED_AT_DEFAULT = {("strix_large", "pool.capacity_factor")}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_profile_loads_validates_and_sets_only_what_differs(path):
    cfg = load_config(path.stem)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# "), "a profile starts with a comment naming the hardware"
    assert profile_description(path.stem), "a profile carries a description"
    defaults = config_to_dict(Config())
    for section, table in tomllib.loads(text).items():
        if section == "description":
            continue
        for key, value in table.items():
            if (path.stem, f"{section}.{key}") not in PINNED_AT_DEFAULT:
                assert value != defaults[section][key], f"{section}.{key} equals the default"


def test_strix_large_is_dropless_and_h200_uses_expandable_segments():
    assert load_config("strix_large").pool.capacity_factor == 0.0
    assert load_config("strix_large").memory.alloc_conf == ""
    assert load_config("h200").memory.alloc_conf == "expandable_segments:True"


def test_dense_width_is_the_pools_active_width_unless_set():
    cfg = load_config(None, ["pool.top_k=4", "pool.d_expert=96"])
    assert cfg.dense_width == 384 == cfg.pool.dense_width
    assert load_config(None, ["pool.top_k=4", "model.d_dense=320"]).dense_width == 320


def test_format_1_config_dicts_move_their_pool_keys_under_pool():
    old = {"model": {"n_rows": 3, "n_experts": 16, "top_k": 4, "sink_ratio": 5.0}, "train": {"steps": 90}}
    new = upgrade_config_dict(old)
    assert new == {"model": {"n_rows": 3}, "pool": {"n_experts": 16, "top_k": 4, "sink_ratio": 5.0},
                   "train": {"steps": 90}}
    assert upgrade_config_dict(new) == new and old["model"]["n_experts"] == 16  # idempotent, not in place
    assert config_from_dict(new).pool.top_k == 4


def test_the_routing_recipes_keys_default_to_todays_and_refuse_bad_values_in_one_line():
    pool = load_config(None).pool
    assert (pool.shared_experts, pool.router_score) == (0, "softmax")
    assert error_of(load_config, None, ["pool.router_score=tanh"]) == (
        "--set pool.router_score: pool.router_score = \"tanh\" is not one of: softmax, sigmoid")
    assert error_of(load_config, None, ["pool.shared_experts=-2"]) == (
        "--set pool.shared_experts: pool.shared_experts = -2 is impossible: must be >= 0")
    assert "expected an integer" in error_of(load_config, None, ["pool.shared_experts=1.5"])
    cfg = load_config(None, ["pool.top_k=3", "pool.d_expert=96", "pool.shared_experts=1"])
    assert cfg.dense_width == 384 == (3 + 1) * 96  # the twin's equal-compute width counts the shared experts
