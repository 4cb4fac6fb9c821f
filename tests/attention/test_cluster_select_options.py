"""``"cluster-select"``'s experimental options (:class:`ExperimentalClusterSelectOptions`): kept apart from the
main options, built by the registry where options name them (recorded runs, ``--attention`` strings), checked as
before. Their layers are held to the dense reference in test_layers.py."""

from __future__ import annotations

import pytest

from clusterformer._specs import parse_spec
from clusterformer.attention import build, describe
from clusterformer.attention.cluster_select import ClusterSelectOptions, ExperimentalClusterSelectOptions
from clusterformer.attention.registry import make_options

EXPERIMENTAL = ("page_size", "balance", "position_splits", "split_size", "split_selection")


def test_the_main_options_leave_the_experimental_ones_out():
    """``describe`` lists the main options alone; options that name none build the main class, options that name
    one (a recorded ``--attention`` string, a run's options) the experimental class; a name in neither is refused
    with the valid names."""
    listed = describe("cluster-select")["options"]
    assert not set(EXPERIMENTAL) & set(listed)
    assert type(make_options("cluster-select", {"num_clusters": 8})) is ClusterSelectOptions
    name, options = parse_spec("cluster-select:num_clusters=8,position_splits=8,split_size=128,select=4")
    built = make_options(name, options)
    assert type(built) is ExperimentalClusterSelectOptions
    assert (built.num_groups, built.experiments) == (64, {"position_splits": 8, "split_size": 128})
    balanced = make_options(*parse_spec("cluster-select:num_clusters=64,select=4,balance=0.05"))
    assert balanced.balance_rate == 0.05 and balanced.num_groups == 64
    assert build("cluster-select", dim=16, heads=2, balance=0.5).inner.balance_bias.shape == (2, 16)
    assert "balance_bias" not in build("cluster-select", dim=16, heads=2).state_dict(), \
        "without balance the state is what earlier checkpoints hold"
    # every experimental option at its default: the main configuration, as a recorded run of it lists them
    plain = make_options("cluster-select", {"page_size": 0, "balance": 0.0, "position_splits": 1, "split_size": 0,
                                            "split_selection": "groups"})
    assert plain.experiments == {} and plain.num_groups == 16 and plain.by_cluster == 0
    with pytest.raises(ValueError, match=r"unknown option 'splits' .* valid options: .*position_splits"):
        make_options("cluster-select", {"splits": 2})
    with pytest.raises(TypeError):
        ClusterSelectOptions(position_splits=2)


def test_experimental_options_are_checked():
    """The experimental options' checks and budgets: groups of position_splits spans, each with its summary (the
    budget of as many clusters); split_selection="clusters" with neither the own group nor the sink."""
    shape = {"select": 4, "cluster_keys": 24, "window": 32}
    split = ExperimentalClusterSelectOptions(num_clusters=8, position_splits=4, split_size=128, **shape)
    as_many = ClusterSelectOptions(num_clusters=32, **shape)
    assert split.num_groups == 32 and split.keys_per_query(1024) == as_many.keys_per_query(1024)
    assert split.for_budget(256, 1024) == as_many.for_budget(256, 1024)
    assert ExperimentalClusterSelectOptions(num_clusters=4, position_splits=2, split_size=8, select=8).select == 8
    bound = ExperimentalClusterSelectOptions(selection="bound", position_splits=2, split_size=8)
    assert bound.keys_per_query(1024) == ClusterSelectOptions(selection="bound", num_clusters=32).keys_per_query(1024)
    clusters = ExperimentalClusterSelectOptions(num_clusters=4, position_splits=2, split_size=8, select=4,
                                                split_selection="clusters")
    assert (clusters.own_group, clusters.sink, clusters.by_cluster) == (False, 0, 2)
    assert ExperimentalClusterSelectOptions(grouping="position", page_size=5).page == 5
    assert ExperimentalClusterSelectOptions(grouping="position", cluster_keys=12).page == 12
    for bad, message in (({"position_splits": 2}, "split_size"), ({"split_size": 8}, "position_splits > 1"),
                         ({"position_splits": 0}, "position_splits"),
                         ({"position_splits": 2, "split_size": 8, "summaries": False, "selection": "scores"},
                          "selection='summaries'"),
                         ({"position_splits": 2, "split_size": 8, "grouping": "position"}, "grouping='kmeans'"),
                         ({"position_splits": 2, "split_size": 8, "grouping": "random", "summaries": False,
                           "selection": "random"}, "selection='summaries'"),
                         ({"num_clusters": 4, "position_splits": 2, "split_size": 8, "select": 9},
                          "x position_splits"),
                         ({"split_selection": "clusters"}, "position_splits > 1"),
                         ({"split_selection": "spans"}, "split_selection"),
                         ({"num_clusters": 4, "position_splits": 2, "split_size": 8, "select": 5,
                           "split_selection": "clusters"}, "at most num_clusters=4"),
                         ({"sink": 1, "position_splits": 2, "split_size": 4, "split_selection": "clusters"},
                          "split_selection='groups'"),
                         ({"own_group": True, "position_splits": 2, "split_size": 4, "split_selection": "clusters"},
                          "split_selection='groups'"),
                         ({"page_size": 8}, "page_size=8 needs grouping='position'"),
                         ({"page_size": -1, "grouping": "position"}, "page_size"),
                         ({"balance": 0.1, "grouping": "random"}, "balance=0.1 .* needs grouping='kmeans'"),
                         ({"balance": -1.0}, "balance")):
        with pytest.raises(ValueError, match=message):
            ExperimentalClusterSelectOptions(**bad)
