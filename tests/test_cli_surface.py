"""The CLI as a surface: dry runs, JSON reports, help text, version, the Python API under it, hub errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY, subprocess_env

SCHEMA = re.compile(r"^inkling-ckpt/[a-z0-9-]+/\d+$")


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root (hidden ones included) with its size and mtime."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def keys(obj: object) -> set[str]:
    """Every dict key anywhere in a JSON value."""
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in keys(v)}
    return set()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """One input of each kind the writing commands take, made through the CLI."""
    from inkling_ckpt.cli.app import main

    base = tmp_path_factory.mktemp("inputs")
    made = {}
    for name, args in [("megatron", ["convert", "hf-to-megatron", TINY["bf16"], base / "megatron", "-q"]),
                       ("sharded", ["shard", TINY["bf16"], base / "sharded", "--tp", "1", "-q"]),
                       ("dump", ["make-fixture", base / "dump", "--lora", "--lora-rank", "4"]),
                       ("adapter", ["lora", "export", base / "dump", base / "adapter", "--config", TINY["bf16"], "-q"])]:
        main([str(a) for a in args])
        made[name] = base / name
    return made


def writing_commands(inputs: dict[str, Path], dst: Path) -> dict[str, list]:
    return {
        "make-fixture": ["make-fixture", dst, "--variant", "mixed"],
        "make-fixture --lora": ["make-fixture", dst, "--lora"],
        "quantize": ["quantize", TINY["bf16"], dst, "--plan", "0-1:nvfp4,2-3:mxfp8"],
        "dequantize": ["dequantize", TINY["mixed"], dst],
        "hf-to-hf": ["convert", "hf-to-hf", TINY["mixed"], dst, "--plan", "mxfp8"],
        "hf-to-megatron": ["convert", "hf-to-megatron", TINY["mixed"], dst],
        "megatron-to-hf": ["convert", "megatron-to-hf", inputs["megatron"], dst, "--reference", TINY["bf16"]],
        "shard": ["shard", TINY["mixed"], dst, "--tp", "2", "--ep", "2"],
        "shard --merge": ["shard", inputs["sharded"], dst, "--merge"],
        "lora export": ["lora", "export", inputs["dump"], dst, "--config", TINY["bf16"]],
        "lora merge": ["lora", "merge", TINY["mixed"], inputs["adapter"], dst],
    }


def test_dry_run_writes_nothing_on_every_writing_command(cli, inputs, tmp_path):
    """Tree unchanged, no output, no staging folder, no done record; the JSON report says what would be written."""
    before_inputs = tree(inputs["dump"].parent)
    for name, args in writing_commands(inputs, tmp_path / "out").items():
        code, out, err = cli(*args, "--dry-run", "--json")
        assert code == 0, f"{name}: {err}"
        rep = json.loads(out)
        assert SCHEMA.match(rep["schema"]) and rep["schema"].endswith("-dry-run/1"), name
        assert rep["status"] == "dry-run" and rep["output"] == str(tmp_path / "out"), name
        assert list(tmp_path.iterdir()) == [], f"{name} wrote {list(tmp_path.iterdir())}"
        code, out, err = cli(*args, "--dry-run")  # the text form writes nothing either
        assert code == 0 and "nothing written" in out, f"{name}: {out}{err}"
        assert list(tmp_path.iterdir()) == [], name
    assert tree(inputs["dump"].parent) == before_inputs


def test_every_report_has_a_schema_and_one_name_per_thing(cli, inputs, tmp_path):
    runs = {name: [*args, "-q"] for name, args in writing_commands(inputs, tmp_path / "o").items()}
    runs.update({
        "inspect": ["inspect", TINY["mixed"]],
        "memory": ["memory", TINY["mixed"], "--tp", "2", "--ep", "2"],
        "verify": ["verify", TINY["bf16"], TINY["mixed"], "-q"],
        "lora inspect": ["lora", "inspect", inputs["adapter"]],
    })
    schemas = set()
    for i, (name, args) in enumerate(runs.items()):
        args = [a if a != tmp_path / "o" else tmp_path / f"o{i}" for a in args]
        code, out, err = cli(*args, "--json")
        assert code == 0, f"{name}: {err}"
        rep = json.loads(out)
        assert SCHEMA.match(rep["schema"]), name
        schemas.add(rep["schema"])
        # a plan is a precision_plan or a parallel_plan; an input is a source (never path/plan)
        assert not keys(rep) & {"plan", "path", "source_plan"}, f"{name}: {sorted(keys(rep) & {'plan', 'path'})}"
    assert len(schemas) == len(runs) - 1  # make-fixture and make-fixture --lora share a schema
    # a LoRA rank and alpha have the adapter_config names in every report (export, inspect, the dump)
    rank_keys = [set(json.loads(cli(*args, "--json")[1])) & {"r", "lora_alpha", "rank", "alpha"} for args in
                 (["lora", "inspect", inputs["adapter"]], ["make-fixture", tmp_path / "d", "--lora", "--dry-run"],
                  ["lora", "export", inputs["dump"], tmp_path / "a", "--config", TINY["bf16"], "--dry-run"])]
    assert rank_keys == [{"r", "lora_alpha"}] * 3
    assert json.loads(cli("inspect", TINY["mixed"], "--json")[1])["precision_plan"] == "0-1:nvfp4,2-3:mxfp8"
    assert json.loads(cli("memory", TINY["mixed"], "--tp", "2", "--ep", "2", "--json")[1])["parallel_plan"] == \
        {"tp": 2, "ep": 2, "moe_tp": 1}


def test_sizes_people_read_are_decimal_everywhere(cli, inputs, tmp_path, monkeypatch):
    from inkling_ckpt.units import fmt_bytes

    assert (fmt_bytes(394_000_000_000), fmt_bytes(3_078_352), fmt_bytes(999), fmt_bytes(2**20, "MB")) == \
        ("394.00 GB", "3.08 MB", "999 B", "1.05 MB")
    outs = [cli("inspect", TINY["mixed"])[1], cli("quantize", TINY["bf16"], tmp_path / "q", "--plan", "mxfp8", "-q")[1],
            cli("lora", "inspect", inputs["adapter"])[1], cli("memory", TINY["mixed"], "--tp", "1")[1],
            cli("shard", TINY["bf16"], tmp_path / "s", "--tp", "1", "-q")[1]]
    text = "\n".join(outs)
    assert not re.search(r"\b[KMGT]iB\b", text), text
    assert "3.08 MB" in outs[0]
    from inkling_ckpt import progress

    got = {}
    monkeypatch.setattr(progress, "tqdm", lambda **kw: got.update(kw))
    progress.ByteProgress(10, desc="x")
    assert got["unit_divisor"] == 1000  # the bar's "G" is a GB as well


def _help(cli, *path: str) -> str:
    code, out, err = cli(*path, "--help")
    assert code == 0, err
    return out


def _commands():
    """(command path, the function typer registered) for every leaf command."""
    from inkling_ckpt.cli.app import _register, app

    _register()

    def walk(t, path):
        for c in t.registered_commands:
            yield [*path, c.name or c.callback.__name__], c.callback
        for g in t.registered_groups:
            yield from walk(g.typer_instance, [*path, g.name or g.typer_instance.info.name])

    return list(walk(app, []))


def _params(fn):
    """(name, annotation, typer's Option/Argument info) of a command function."""
    import inspect
    import typing

    hints = typing.get_type_hints(fn)
    for name, p in inspect.signature(fn).parameters.items():
        ann = hints[name]
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        yield name, (args[0] if args else ann), p.default


def test_help_shows_choices_and_upper_metavars_on_every_command(cli):
    """Every option with fixed values is an Enum and its help shows the choices; every other value option
    and every argument has an UPPER metavar; the option list shows no bare `<str>`/`<path>` type."""
    from enum import Enum

    from typer.models import ArgumentInfo, OptionInfo

    commands = _commands()
    assert len(commands) == 13
    enum_like = {"--scales", "--preset", "--variant", "--size", "--embed-dtype", "--kv-dtype", "--dtype"}
    seen = set()
    for path, fn in commands:
        text = _help(cli, *path)
        options = text.split("Options:")[1]
        assert "<str>" not in options and "<path>" not in options and "<int>" not in options, (path, text)
        for name, ann, info in _params(fn):
            if isinstance(info, ArgumentInfo):
                assert info.metavar and info.metavar.isupper(), (path, name)
                continue
            assert isinstance(info, OptionInfo), (path, name)
            long = [d for d in info.param_decls if d.startswith("--")][0]
            if isinstance(ann, type) and issubclass(ann, Enum):
                seen.add(long)
                shown = "<" + "|".join(m.value for m in ann) + ">"
                assert f"{long} {shown}" in options, (path, long, options)
            elif ann is not bool and not info.count:
                assert long not in enum_like, f"{path} {long} takes free text"
                assert info.metavar and info.metavar.isupper(), (path, long, info.metavar)
    assert seen == enum_like
    # hf-to-hf --scales keep speaks of SRC, not of a --reference the command lacks
    assert "--reference" not in _help(cli, "convert", "hf-to-hf")


def test_choice_enums_match_the_library():
    from inkling_ckpt.cli.options import KvDtype, Preset, Scales
    from inkling_ckpt.convert.experts import SCALE_POLICIES
    from inkling_ckpt.model.mapping import PRESETS
    from inkling_ckpt.plan.memory import KV_DTYPES

    assert [p.value for p in Preset] == list(PRESETS)
    assert [k.value for k in KvDtype] == list(KV_DTYPES)
    assert [s.value for s in Scales] == sorted(SCALE_POLICIES)


def test_scales_keep_without_kept_scales_is_refused_or_explained(cli, tmp_path, inputs):
    code, _, err = cli("convert", "hf-to-hf", TINY["bf16"], tmp_path / "o", "--plan", "mxfp8", "--scales", "keep")
    assert code == 2 and "no scales to keep; use --scales fresh" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("quantize", TINY["bf16"], tmp_path / "o", "--plan", "mxfp8", "--scales", "keep")
    assert code == 2 and "no scales to keep" in err
    assert list(tmp_path.iterdir()) == []
    code, out, err = cli("convert", "megatron-to-hf", inputs["megatron"], tmp_path / "o", "--reference", TINY["mixed"],
                         "--plan", "bf16", "--dry-run", "--json")
    assert code == 0, err
    assert any("every layer is encoded fresh" in n for n in json.loads(out)["notes"])


def test_usage_errors_are_one_line(cli):
    code, _, err = cli("quantize", TINY["bf16"])
    assert code == 2 and err.startswith("inkling-ckpt: error: Missing argument 'DST'") and len(err.splitlines()) == 1
    code, _, err = cli("inspect", TINY["bf16"], "--bogus")
    assert code == 2 and "No such option: --bogus" in err and len(err.splitlines()) == 1


def test_version_completion_verbose(cli):
    from inkling_ckpt import __version__

    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == f"inkling-ckpt {__version__}"
    root = _help(cli)
    assert "--install-completion" in root and "--show-completion" in root
    for path, fn in _commands():
        opts = {d for _, _, info in _params(fn) for d in (info.param_decls or ())}
        assert {"-v", "--verbose", "--json"} <= opts, path
    code, out, err = cli("quantize", TINY["bf16"], "/tmp/never-written", "--plan", "mxfp8", "--dry-run", "-v")
    assert code == 0 and "inkling-ckpt: quantize: " in err and "-> /tmp/never-written (0-3:mxfp8)" in err, err
    assert cli("quantize", TINY["bf16"], "/tmp/never-written", "--plan", "mxfp8", "--dry-run")[2] == ""
    code, out, err = cli("inspect", "/no/such/folder", "-vv")
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("inkling-ckpt: error:")


def test_help_and_import_do_not_load_torch():
    """`--help` (every command's) and `import inkling_ckpt` answer without importing torch."""
    probe = (
        "import sys\n"
        "from inkling_ckpt.cli.app import main\n"
        "for args in (['--help'], ['convert', 'hf-to-hf', '--help'], ['lora', 'merge', '--help'], ['memory', '-h'],\n"
        "             ['verify', '--help'], ['shard', '--help'], ['quantize', '--help'], ['--version']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, (args, e.code)\n"
        "import inkling_ckpt\n"
        "heavy = sorted(m for m in ('torch', 'safetensors', 'numpy', 'huggingface_hub') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env(), cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "HEAVY []", r.stdout[-500:]


@pytest.mark.parametrize("given", [None, "0"], ids=["default", "user-setting"])
def test_the_cli_turns_on_torch_huge_pages_before_torch_loads(given):
    """Every slice lands in fresh memory; torch reads THP_MEM_ALLOC_ENABLE once, at its first
    allocation, so the CLI sets it before anything imports torch, and a user's own value wins."""
    env = {k: v for k, v in subprocess_env().items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    probe = ("import os, sys\n"
             "from inkling_ckpt.cli.app import main\n"
             "try:\n    main(['inspect', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
             "print('THP', os.environ.get('THP_MEM_ALLOC_ENABLE'), 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", probe, str(TINY)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"THP {given or '1'} True", r.stdout[-500:]


# ---- the Python API ---------------------------------------------------------------------------------

def test_api_is_lazy_and_every_job_is_there():
    import inkling_ckpt
    from inkling_ckpt import api

    for name in ("quantize", "dequantize", "convert_hf_to_megatron", "convert_megatron_to_hf", "convert_hf_to_hf",
                 "shard", "merge_shards", "verify_tensors", "verify_forward", "inspect", "memory", "lora_export",
                 "lora_merge", "lora_inspect", "make_fixture"):
        assert getattr(inkling_ckpt, name) is getattr(api, name), name
        assert getattr(api, name).__doc__, name
    with pytest.raises(AttributeError):
        inkling_ckpt.no_such_job  # noqa: B018


def test_api_round_trip_matches_the_cli(tmp_path):
    import inkling_ckpt as ic
    from conftest import same_files

    rep = ic.quantize(TINY["bf16"], tmp_path / "q", plan="0-1:nvfp4,2-3:mxfp8", max_shard_size="2MB")
    assert rep["status"] == "written" and rep["schema"] == "inkling-ckpt/quantize/1"
    assert same_files(TINY["mixed"], tmp_path / "q") == []
    assert ic.quantize(TINY["bf16"], tmp_path / "q", plan="0-1:nvfp4,2-3:mxfp8", max_shard_size="2MB")["status"] == \
        "skipped"
    assert ic.inspect(tmp_path / "q")["precision_plan"] == "0-1:nvfp4,2-3:mxfp8"
    assert ic.verify_tensors(TINY["mixed"], tmp_path / "q", exact=True)["thresholds"]["passed"]


def test_the_cli_is_a_thin_layer_over_the_api(cli, monkeypatch, tmp_path):
    from inkling_ckpt import api

    calls = []

    def fake(src, dst, plan, **kw):
        calls.append((src, dst, plan, kw))
        return {"schema": api.schema("quantize"), "command": "quantize", "source": src, "output": str(dst),
                "status": "written", "tensors": 1, "bytes": 2}

    monkeypatch.setattr(api, "quantize", fake)
    code, out, err = cli("quantize", "S", tmp_path / "D", "--plan", "mxfp8", "--scales", "keep", "--reference", "R",
                         "--max-shard-size", "1GB", "-q", "--json")
    assert code == 0, err
    assert calls == [("S", tmp_path / "D", "mxfp8", {"scales": "keep", "reference": "R", "max_shard_size": "1GB",
                                                     "allow_nonfinite": False, "force": False, "dry_run": False,
                                                     "progress": False, "dtype": None, "device": "auto", "slice_mb": 0,
                                                     "workers": 0, "memory_mb": 0})]
    assert json.loads(out)["tensors"] == 1


# ---- make-fixture --lora: the three-command walk of the README --------------------------------------

def test_lora_walk_from_make_fixture(cli, tmp_path):
    from safetensors import safe_open

    from inkling_ckpt.lora.schema import SCHEMA as LORA_SCHEMA

    code, out, err = cli("make-fixture", tmp_path / "dump", "--lora")
    assert code == 0 and "LoRA trainer dump" in out, err
    with safe_open(str(tmp_path / "dump" / "lora.safetensors"), "pt") as f:
        names = list(f.keys())
        assert f.metadata()["lora_alpha"] == "16"
    assert names and all(LORA_SCHEMA.trainer(n) is not None for n in names)  # Megatron-Bridge names, all in the table
    code, out, err = cli("lora", "export", tmp_path / "dump", tmp_path / "adapter", "--config", TINY["bf16"], "-q")
    assert code == 0 and "r=8, alpha=16" in out, err
    code, out, err = cli("lora", "merge", TINY["mixed"], tmp_path / "adapter", tmp_path / "merged", "-q")
    assert code == 0 and "tensors merged" in out, err
    code, out, err = cli("verify", TINY["mixed"], tmp_path / "merged", "--exact", "-q")
    assert code == 1  # the adapter changed the weights
    code, out, _ = cli("make-fixture", tmp_path / "dump", "--lora")
    assert code == 0 and "nothing to do" in out
    for alpha in ("0", "-2"):  # a dump that lora export would refuse is not written
        code, _, err = cli("make-fixture", tmp_path / "bad-dump", "--lora", "--lora-alpha", alpha)
        assert code == 2 and f"--lora-alpha {alpha}: must be a positive number" in err and err.count("\n") == 1, err
        assert not (tmp_path / "bad-dump").exists()


# ---- hub sources -------------------------------------------------------------------------------------

def _hub_error(name: str) -> Exception:
    from huggingface_hub import errors

    cls = getattr(errors, name)
    e = cls.__new__(cls)
    Exception.__init__(e, f"{name} raised")
    return e


@pytest.mark.parametrize("raised,why", [
    ("OfflineModeIsEnabled", "offline mode is on (HF_HUB_OFFLINE)"),
    ("GatedRepoError", "a gated repo: accept its terms"),
    ("RepositoryNotFoundError", "no such repo on the hub, or it is private"),
    ("RevisionNotFoundError", "the repo has no revision 'v9'"),
    ("LocalEntryNotFoundError", "the hub could not be reached (network)"),
    (ConnectionError("connection reset"), "the hub could not be reached (network: connection reset)"),
])
def test_hub_fetch_failures_say_why_in_one_line(cli, monkeypatch, raised, why):
    import huggingface_hub
    import huggingface_hub.constants as hc

    def fail(*a, **kw):
        raise _hub_error(raised) if isinstance(raised, str) else raised

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    code, _, err = cli("inspect", "org/model", "--revision", "v9")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("inkling-ckpt: error: org/model@v9: not a local folder, and cannot fetch it from the hub: ")
    assert why in err, err


def test_hub_offline_cache_miss_says_offline(cli, monkeypatch):
    import huggingface_hub
    import huggingface_hub.constants as hc

    def fail(*a, **kw):
        raise _hub_error("LocalEntryNotFoundError")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    code, _, err = cli("inspect", "org/model")
    assert code == 2 and "offline mode is on (HF_HUB_OFFLINE) and the repo is not in the local cache" in err


def test_hub_revision_and_token_reach_the_fetch(cli, monkeypatch, tmp_path):
    import huggingface_hub

    got = []

    def fetch(repo, **kw):
        got.append((repo, kw["revision"], kw["token"]))
        return str(TINY["bf16"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert cli("inspect", "org/model", "--revision", "v1", "--token", "hf_x", "--json")[0] == 0
    assert cli("inspect", "org/model@abc123", "--json")[0] == 0
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    code, out, err = cli("quantize", "org/model", tmp_path / "q", "--plan", "mxfp8", "--revision", "main", "--dry-run")
    assert code == 0, err
    assert got == [("org/model", "v1", "hf_x"), ("org/model", "abc123", None), ("org/model", "main", "hf_env")]
    code, _, err = cli("inspect", "org/model@abc123", "--revision", "v1")
    assert code == 2 and "names revision 'abc123' but --revision says 'v1'" in err
    assert os.environ["HF_TOKEN"] == "hf_env"


def test_shell_completion_completes_commands_and_choices():
    """The completion hook `--install-completion` installs answers (bash protocol), without torch."""
    probe = ("import sys\nsys.argv = ['inkling-ckpt']\nfrom inkling_ckpt.cli.app import main\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules)\n")
    for words, cword, want in (("inkling-ckpt conv", 1, "convert"),
                               ("inkling-ckpt convert hf-to-hf --scales ", 4, "fresh\nkeep")):
        env = {**subprocess_env(), "_INKLING_CKPT_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(cword)}
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert r.stdout.startswith(want), (words, r.stdout, r.stderr)
        assert r.stdout.strip().splitlines()[-1] == "TORCH False", r.stdout
