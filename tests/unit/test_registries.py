"""The extension registries (flodl/config/registries/): each axis declared once and read by
config, code and docs.

Sync modes (``modes.py``): every mode has one policy and one rank-side class, and no module
outside the registry branches on a mode's name. Link profiles (``link_profiles.py``): the schema
accepts exactly the registry's names, the rig charges its figures, the docs' table renders them.
Memory-plan elements (``plan_elements.py``): the parser, the auto search and the launch-time
rules iterate the registry, and no module outside it matches an element's name. Compression
codecs (``codecs.py``): the schema, the collectives and the controller's codec read the
registry, and nothing outside it branches on a codec's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flodl.config import ELCHE_PRESETS, MODES, ElCheConfig, Mode, resolve_dotted

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flodl"


# -- sync modes -------------------------------------------------------------------------------
def test_every_mode_is_declared_once_with_its_rank_side_class():
    from flodl.runtime.rank.sync_modes import SyncMode

    assert list(MODES) == list(Mode)
    for mode, policy in MODES.items():
        assert policy.mode is mode and mode.policy is policy
        assert issubclass(resolve_dotted(policy.rank_side), SyncMode), mode
        assert policy.summary and ELCHE_PRESETS[mode] == dict(policy.preset)


def test_what_the_policies_say_is_what_the_modes_did():
    """The policies restate the behaviour the controller's branches had (behaviour unchanged)."""
    flags = {
        m.value: (p.lock_step, p.via_controller, p.gradient_sync, p.overshoot, p.alone)
        for m, p in MODES.items()
    }
    assert flags == {
        "nccl_sync": (True, False, True, False, False),
        "nccl_cadence": (False, False, False, False, False),
        "cpu_sync": (True, True, False, False, False),
        "cpu_cadence": (False, True, False, False, False),
        "cpu_async": (False, True, False, True, False),
        "solo": (False, False, False, False, True),
    }
    assert [m.value for m, p in MODES.items() if p.settles] == ["nccl_sync", "nccl_cadence"]
    assert [m.value for m, p in MODES.items() if p.compress_refusal] == ["nccl_sync", "solo"]
    assert ElCheConfig.cpu_async().effective_easgd_alpha == 0.5
    assert ElCheConfig.cpu_cadence().effective_easgd_alpha is None


def _mode_branches(path: Path, root: Path = ROOT) -> list[str]:
    """``Mode.X`` members and mode-name strings compared in ``path``'s code (a branch on a
    mode's name), as ``file:line``."""
    names = {m.value for m in Mode}
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        member = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        if member and node.value.id == "Mode" and node.attr.isupper():  # type: ignore[union-attr]
            found.append(f"{path.relative_to(root)}:{node.lineno}")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) and s.value in names for s in sides):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_branch_finder_sees_members_and_names(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "if mode is Mode.SOLO or cfg.mode == 'cpu_async':\n    pass\nx = Mode('solo')\n"
    )
    assert _mode_branches(path, tmp_path) == ["m.py:1", "m.py:1"]


# Where a mode is named on purpose: the registry itself, and the public presets
# (ElCheConfig.nccl_sync() ...), which name each mode once.
DECLARES_MODES = {"flodl/config/registries/modes.py", "flodl/config/elche.py"}


def test_no_module_outside_the_registry_branches_on_a_mode():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(ROOT)) not in DECLARES_MODES
        for hit in _mode_branches(path)
    ]
    assert found == [], f"branches on a mode's name outside registries/modes.py: {found}"


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
def test_a_sync_mode_object_is_the_policys_class(mode):
    """sync_for builds the class the policy names (a collective mode alone: solo's)."""
    import queue
    from types import SimpleNamespace

    import torch

    from flodl.runtime.rank.peers import Peers
    from flodl.runtime.rank.setup import ModelParts
    from flodl.runtime.rank.sync_modes import SoloSync, sync_for
    from flodl.runtime.sync.averaging import FlatState
    from flodl.runtime.wire.rank_link import QueueLink

    if mode.policy.gradient_sync:
        pytest.skip("its gradient hooks are tests/unit/test_sync_modes.py's")
    model = torch.nn.Linear(2, 2)
    parts = ModelParts(model, model, FlatState(model), None, SimpleNamespace(), model.weight.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for world in (2, 1):
        peers = Peers(0, world, QueueLink(queue.Queue(), queue.Queue()), wait_s=1.0)
        sync = sync_for(peers, parts, None, optimizer, ElCheConfig(mode=mode))  # type: ignore[arg-type]
        if world == 2:
            assert type(sync) is resolve_dotted(mode.policy.rank_side)
        else:
            assert isinstance(sync, SoloSync) != mode.policy.via_controller


# -- link profiles ----------------------------------------------------------------------------
def test_the_schema_takes_exactly_the_registrys_link_names():
    from flodl.config import ClusterConfig, ConfigError, validate_run_config
    from flodl.config.registries.link_profiles import LINK_NAMES, LINK_PROFILES

    assert ("none", *LINK_PROFILES) == LINK_NAMES
    for name in LINK_NAMES:
        cluster = ClusterConfig(kind="cpu_rig", link={"profile": name, "between_hosts": name})
        assert cluster.link.profile == name
    with pytest.raises(ConfigError, match=r"cluster.link.profile=2gbe: Input should be 'none'"):
        validate_run_config({**_minimal_run(), "cluster": {"kind": "cpu_rig", "link": "2gbe"}})


def _minimal_run() -> dict:
    return {
        "model": {"_target_": "flodl.recipes.models.MLP"},
        "optimizer": {"_target_": "torch.optim.Adam"},
        "dataset": {"_target_": "flodl.recipes.datasets.synthetic"},
        "task": {"train_step": "flodl.recipes.steps.classification_step"},
    }


def test_the_rig_charges_the_registrys_figures():
    from flodl.config.registries.link_profiles import LINK_PROFILES
    from flodl.rig.links import Wire, wire_for

    assert wire_for("none") is None
    for name, p in LINK_PROFILES.items():
        assert wire_for(name) == Wire(p.bandwidth_gbps, p.latency_ms, p.staged)
    assert wire_for("none", bandwidth_gbps=2.0) == Wire(2.0, 0.0, False)


def _hook():
    """docs/hooks/registry_tables.py, the MkDocs hook that renders the registries' tables."""
    import importlib.util

    path = ROOT / "docs" / "hooks" / "registry_tables.py"
    spec = importlib.util.spec_from_file_location("registry_tables", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_registry():
    from flodl.config.registries.link_profiles import LINK_PROFILES

    page = (ROOT / "docs" / "guides" / "cpu-rig.md").read_text(encoding="utf-8")
    assert "<!-- registry: links -->" in page
    table = _hook().render("<!-- registry: links -->")
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == [
        "`none` (default)",
        *(f"`{name}`" for name in LINK_PROFILES),
    ]


# -- memory-plan elements ---------------------------------------------------------------------
def test_auto_tries_the_plans_it_tried_before_cheapest_first():
    from flodl.config.registries.plan_elements import auto_candidates, fallback_plan, words

    alone = [(), ("recompute",), ("offload",), ("recompute", "offload")]
    assert auto_candidates(cohort=False) == alone
    cohort = [(), ("recompute",), ("shard",), ("recompute", "shard"), *alone[2:]]
    assert auto_candidates(cohort=True) == cohort
    assert fallback_plan() == ("recompute", "offload")
    assert words(fallback_plan()) == "activation checkpointing and optimizer state on host"


def test_the_parser_reads_the_registry():
    from flodl.config.registries.plan_elements import PLAN_ELEMENTS, parse_memory_plan

    assert parse_memory_plan("offload+recompute") == ("recompute", "offload")
    for name, element in PLAN_ELEMENTS.items():
        assert parse_memory_plan(name) == (name,)
        for other in element.excludes:
            with pytest.raises(ValueError, match=f"{name} and {other} do not combine"):
                parse_memory_plan(f"{other}+{name}")


def test_each_element_names_its_rank_side_application():
    import inspect

    from flodl.config.registries.plan_elements import PLAN_ELEMENTS

    for element in PLAN_ELEMENTS.values():
        apply = resolve_dotted(element.rank_side)
        params = ["memory", "target", "optimizer", "chosen", "cohort"]
        assert list(inspect.signature(apply).parameters) == params


def test_a_mode_an_element_needs_is_checked_from_the_registry():
    from flodl.config import ClusterConfig, TrainerConfig

    cluster = ClusterConfig(kind="cpu_rig", memory_plan="shard")
    TrainerConfig(cluster=cluster, elche=ElCheConfig.nccl_sync())
    with pytest.raises(ValueError, match=r"shard splits training state .* elche.mode=nccl_sync"):
        TrainerConfig(cluster=cluster, elche=ElCheConfig.cpu_sync())


def _element_matches(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """An element's name compared (``"shard" in plan``) or listed (``("recompute", ...)``) in
    ``path``'s code, as ``file:line``; messages and docstrings are not code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        sides: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            sides = list(node.elts)
        if any(isinstance(x, ast.Constant) and x.value in names for x in sides):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_the_element_finder_sees_comparisons_and_lists(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('if "shard" in plan:\n    x = ("recompute", "offload")\nraise E("shard")\n')
    assert _element_matches(path, {"shard", "recompute"}, tmp_path) == ["m.py:1", "m.py:2"]


def test_no_module_outside_the_registry_matches_an_element_name():
    from flodl.config.registries.plan_elements import PLAN_ELEMENTS

    names = set(PLAN_ELEMENTS)
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "plan_elements.py" or path.parent.name != "registries"
        for hit in _element_matches(path, names)
    ]
    assert found == [], f"element names matched outside registries/plan_elements.py: {found}"


def test_the_guides_table_is_the_registry():
    from flodl.config.registries.plan_elements import PLAN_ELEMENTS

    page = (ROOT / "docs" / "guides" / "memory-plans.md").read_text(encoding="utf-8")
    assert "<!-- registry: plan_elements -->" in page
    table = _hook().render("<!-- registry: plan_elements -->")
    firsts = [line.split("|")[1].strip().split(" ")[0] for line in table.splitlines()[2:]]
    assert firsts == [f"`{name}`" for name in PLAN_ELEMENTS]


# -- compression codecs -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bf16", "fp16", "int8"])
def test_each_codec_encodes_as_its_entry_declares(name):
    import torch

    from flodl.config.registries.codecs import CODECS
    from flodl.runtime.sync.codec import pack, unpack
    from flodl.runtime.sync.compress import WireCodec, codec_for

    spec = CODECS[name]
    codec = codec_for(name)
    assert isinstance(codec, WireCodec) and codec.spec is spec
    change = torch.randn(5000)
    values, scales = codec.encode(change)
    assert values.dtype == getattr(torch, spec.wire_dtype)
    assert (scales is not None) == spec.scaled
    assert torch.allclose(codec.decode(values, scales, 5000), change, atol=0.05, rtol=0.02)
    packed = pack(name, change, base=3)
    assert packed.values.numel() == 5000  # a block's padding is not sent
    assert packed.nbytes == pytest.approx(5000 * spec.value_bytes, rel=0.01)
    assert torch.equal(unpack(packed), codec.decode(values, scales, 5000))


def test_the_schema_takes_exactly_the_registrys_codecs():
    from flodl.config.registries.codecs import CODECS, COMPRESS_NAMES

    assert ("none", *CODECS) == COMPRESS_NAMES
    for name in COMPRESS_NAMES:
        assert ElCheConfig.cpu_cadence(compress=name).compress == name
    with pytest.raises(ValueError, match="Input should be 'none', 'bf16'"):
        ElCheConfig.cpu_cadence(compress="int4")


def test_a_codec_that_does_not_stream_is_refused_through_the_controller(monkeypatch):
    import dataclasses

    from flodl.config.registries import codecs

    table = dict(codecs.CODECS)
    table["int8"] = dataclasses.replace(table["int8"], streams=False)
    monkeypatch.setattr(codecs, "CODECS", table)
    monkeypatch.setattr("flodl.config.elche.CODECS", table)
    ElCheConfig.nccl_cadence(compress="int8")  # a collective carries it whole
    with pytest.raises(ValueError, match="sum each change as it streams in"):
        ElCheConfig.cpu_cadence(compress="int8")


def test_no_module_outside_the_registry_branches_on_a_codec():
    from flodl.config.registries.codecs import CODECS

    names = set(CODECS)
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "codecs.py" or path.parent.name != "registries"
        for hit in _element_matches(path, names)
    ]
    assert found == [], f"codec names matched outside registries/codecs.py: {found}"


def test_the_codecs_table_is_the_registry():
    from flodl.config.registries.codecs import CODECS

    page = (ROOT / "docs" / "guides" / "cpu-rig.md").read_text(encoding="utf-8")
    assert "<!-- registry: codecs -->" in page
    table = _hook().render("<!-- registry: codecs -->")
    firsts = [line.split("|")[1].strip().split(" ")[0] for line in table.splitlines()[2:]]
    assert firsts == ["`none`", *(f"`{name}`" for name in CODECS)]
