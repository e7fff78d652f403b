"""SLURM's compressed node lists, expanded as ``scontrol show hostnames`` does."""

from __future__ import annotations

import pytest

from flodl.placement.hostlist import expand, root_node


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("node[001-003,7]", ["node001", "node002", "node003", "node7"]),  # width per range
        ("gpu[9-11]-ib,login", ["gpu9-ib", "gpu10-ib", "gpu11-ib", "login"]),
        ("x[08-10],y[1]", ["x08", "x09", "x10", "y1"]),
    ],
)
def test_expand(nodelist, hosts):
    assert expand(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n[a-b]", "n[5-3]", "n[1]x[2]"])
def test_malformed_lists_are_refused_with_the_list_named(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        expand(bad)


def test_root_node_is_the_first_host(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)  # no scontrol: the parser decides
    assert root_node("node[004-005],other") == "node004"
