"""The CSA2 role plan: what each layer's attention does, derived only from the config's lists.

- ratio 0: SWA-only (its own sliding window, no global branch).
- in kv_source_layers: Full (owns the compressor, the index keys and an indexer; publishes all three).
- in index_source_layers only: Reindex (own indexer queries over the latest KV source's keys).
- any other layer with ratio > 0: Reuse (borrows KV and top-k from the latest sources below it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import networkx as nx

from .config import ModelConfig

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"
ROLE_NAMES = {SWA: "SWA-only", FULL: "Full", REINDEX: "Reindex", REUSE: "Reuse"}
# the diagram's five tabs: Full splits by compress ratio
TABS = ("swa", "full_m2", "full_m1", "reindex", "reuse")
TAB_TITLES = {"swa": "SWA-only", "full_m2": "Full (m=2, encoder)", "full_m1": "Full (m=1, decoder)",
              "reindex": "Reindex", "reuse": "Reuse"}


@dataclass(frozen=True)
class LayerRole:
    layer: int
    role: str                    # swa | full | reindex | reuse
    compress_ratio: int
    kv_source: int | None        # layer whose global KV this layer reads (None: no global branch)
    index_source: int | None     # layer whose top-k this layer uses
    index_key_source: int | None  # layer whose index keys this layer's indexer scores
    in_candidate_pool: bool      # scores only inside the candidate source's pool
    candidate_source: bool       # publishes the candidate pool
    engram: bool                 # an Engram sits before this layer
    dspark_tap: bool             # DSpark reads this layer's input stream
    half: str                    # encoder | decoder | dspark
    is_dspark: bool = False

    @property
    def tab(self) -> str:
        """Which diagram tab draws this layer."""
        if self.role == FULL:
            return "full_m2" if self.compress_ratio > 1 else "full_m1"
        return self.role

    @property
    def label(self) -> str:
        if self.role == FULL:
            return f"Full m={self.compress_ratio}"
        return ROLE_NAMES[self.role]

    def to_dict(self) -> dict:
        return {**asdict(self), "tab": self.tab, "label": self.label}


def decoder_start(cfg: ModelConfig) -> int:
    """First layer of the decoder half: the first KV source with ratio 1 (layer 20 in the release).

    The decoder's global KV is projected once from the encoder's output by that layer, so everything
    from there up is the decoder. Without such a layer the model has no decoder half."""
    for layer in cfg.kv_source_layers:
        if cfg.compress_ratios[layer] == 1:
            return layer
    return cfg.n_layers


def role_plan(cfg: ModelConfig) -> list[LayerRole]:
    """One `LayerRole` per backbone layer, then one per DSpark stage."""
    kv, idx = set(cfg.kv_source_layers), set(cfg.index_source_layers)
    engram, taps = set(cfg.engram_layer_ids), set(cfg.dspark_target_layer_ids)
    split = decoder_start(cfg)
    cand = cfg.candidate_source_layer
    plan: list[LayerRole] = []
    latest_kv: dict[int, int] = {}   # ratio -> latest KV source seen so far
    latest_index: int | None = None
    for layer in range(cfg.n_layers):
        ratio = cfg.compress_ratios[layer]
        half = "encoder" if layer < split else "decoder"
        common = dict(layer=layer, compress_ratio=ratio, engram=layer in engram,
                      dspark_tap=layer in taps, half=half)
        if ratio == 0:
            plan.append(LayerRole(role=SWA, kv_source=None, index_source=None, index_key_source=None,
                                  in_candidate_pool=False, candidate_source=False, **common))
            continue
        if layer in kv:
            latest_kv[ratio] = layer
            latest_index = layer
            role = FULL
        elif layer in idx:
            latest_index = layer
            role = REINDEX
        else:
            role = REUSE
        kv_src = latest_kv[ratio]
        # an index source older than the current KV source scored a different cache
        index_src = latest_index if latest_index is not None and latest_index >= kv_src else kv_src
        plan.append(LayerRole(
            role=role, kv_source=kv_src, index_source=index_src,
            index_key_source=kv_src if role in (FULL, REINDEX) else None,
            in_candidate_pool=role == REINDEX and 0 <= cand < layer and kv_src == cand,
            candidate_source=layer == cand, **common))
    for stage in range(cfg.n_mtp_layers):
        layer = cfg.n_layers + stage
        plan.append(LayerRole(layer=layer, role=SWA, compress_ratio=0, kv_source=None, index_source=None,
                              index_key_source=None, in_candidate_pool=False, candidate_source=False,
                              engram=False, dspark_tap=False, half="dspark", is_dspark=True))
    return plan


def cache_graph(cfg: ModelConfig, plan: list[LayerRole] | None = None) -> nx.DiGraph:
    """Who reads whose cache: an edge reader -> source, labelled with what is read
    ('kv', 'topk', 'index_keys', 'candidates', 'dspark_tap')."""
    plan = plan or role_plan(cfg)
    graph = nx.DiGraph()
    for r in plan:
        graph.add_node(r.layer, role=r.role, tab=r.tab, half=r.half)
    by_layer = {r.layer: r for r in plan}
    for r in plan:
        if r.is_dspark:
            for tap in cfg.dspark_target_layer_ids:
                _add_edge(graph, r.layer, tap, "dspark_tap")
            continue
        if r.kv_source is not None and r.kv_source != r.layer:
            _add_edge(graph, r.layer, r.kv_source, "kv")
        if r.index_source is not None and r.index_source != r.layer:
            _add_edge(graph, r.layer, r.index_source, "topk")
        if r.index_key_source is not None and r.index_key_source != r.layer:
            _add_edge(graph, r.layer, r.index_key_source, "index_keys")
        if r.in_candidate_pool:
            _add_edge(graph, r.layer, cfg.candidate_source_layer, "candidates")
    assert all(by_layer[v].layer <= u for u, v in graph.edges), "a layer may only read caches below it"
    return graph


def _add_edge(graph: nx.DiGraph, reader: int, source: int, what: str) -> None:
    if graph.has_edge(reader, source):
        graph.edges[reader, source]["reads"].append(what)
    else:
        graph.add_edge(reader, source, reads=[what])


def layers_by_tab(plan: list[LayerRole]) -> dict[str, list[int]]:
    """Backbone layers grouped by diagram tab."""
    out: dict[str, list[int]] = {tab: [] for tab in TABS}
    for r in plan:
        if not r.is_dspark:
            out[r.tab].append(r.layer)
    return out
