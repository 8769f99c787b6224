"""The sidebar's model source and prompt."""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from explorer import checkpoint_path, link, prompt as pr
from explorer.screens.common import fail


CUSTOM = "custom"   # the Sample box's entry once the prompt is not a sample's text


def sidebar():
    """Model source and prompt. Returns (source, cfg_path, prompt text, image span or None)."""
    st.sidebar.markdown("### Model")
    options = [pr.SOURCE_SHIPPED, pr.SOURCE_PATH, pr.SOURCE_CONFIG]
    query = st.query_params.to_dict()
    if "source" not in st.session_state:
        st.session_state["source"] = link.source_from_link(query, os.environ, options, pr.SOURCE_SHIPPED)
    source = st.sidebar.radio("Source", options, key="source", format_func=pr.SOURCE_TITLES.get,
                              label_visibility="collapsed")
    path = ""
    if source == pr.SOURCE_SHIPPED:
        path = str(pr.MODEL_DIR)
        if not (pr.MODEL_DIR / "config.json").exists():
            st.sidebar.info("The shipped small model is not in assets/model yet: plan, diagram and tallies use the "
                            "release config; live views need weights.")
            path = str(pr.RELEASE_CONFIG)
    elif source == pr.SOURCE_PATH:
        path = checkpoint_field(query)
    else:
        path = str(pr.RELEASE_CONFIG)
        st.sidebar.caption("Plan, diagram and tallies from assets/configs/v41-flash.json. No weights are loaded.")
    text, span = prompt_fields(path, query)
    return source, path, text, span


def checkpoint_field(query: dict) -> str:
    """The checkpoint folder, checked; a bad one is named next to the field and the release config
    stands in, so the rest of the page still draws."""
    st.session_state.setdefault("ckpt_path", query.get("ckpt") or os.environ.get("EXPLORER_CHECKPOINT", ""))
    path = st.sidebar.text_input("Checkpoint folder", key="ckpt_path", placeholder="/data/v41-flash",
                                 help="A release-layout folder: config.json, model.safetensors.index.json and its "
                                      "shards.").strip()
    if not path:
        st.sidebar.caption("Enter a folder; until then the release config is shown.")
        return str(pr.RELEASE_CONFIG)
    public = checkpoint_path.listens_publicly(st.get_option("server.address"))
    problem = checkpoint_path.checkpoint_problem(path, checkpoint_path.allowed_roots(os.environ, public))
    if problem:
        st.sidebar.error(problem + " The release config is shown meanwhile.")
        return str(pr.RELEASE_CONFIG)
    return path


def prompt_fields(path: str, query: dict):
    """The prompt box (a sample, an upload, or typed; also from the link), its token count and the
    image span. Returns (text, span)."""
    st.sidebar.markdown("### Prompt")
    samples = pr.sample_prompts()
    texts = {s.id: s.text for s in samples}
    titles = {CUSTOM: "(your own prompt)", **{s.id: s.title for s in samples}}
    if "prompt_text" not in st.session_state:
        linked, problem = link.prompt_from_link(query, link.draft_dir())
        if problem:
            st.sidebar.warning(problem)
        if linked is not None:
            st.session_state["prompt_text"] = linked
    picked = st.session_state.get("sample")
    if "prompt_text" in st.session_state and st.session_state["prompt_text"] != texts.get(picked):
        # an edited (or linked, or uploaded) prompt is nobody's sample any more
        st.session_state["sample"] = next((k for k, v in texts.items() if v == st.session_state["prompt_text"]),
                                          CUSTOM)
    st.session_state.setdefault("sample", next(iter(texts), CUSTOM))
    pick = st.sidebar.selectbox("Sample", [CUSTOM, *texts], format_func=titles.get, key="sample",
                                on_change=on_sample, args=(texts,))
    if "prompt_text" not in st.session_state:
        st.session_state["prompt_text"] = texts.get(pick, "")
    upload = st.sidebar.file_uploader("…or upload a text file", type=["txt", "md", "py", "json", "csv"],
                                      key="upload")
    if upload is not None and st.session_state.get("_uploaded") != upload.file_id:
        try:
            st.session_state["prompt_text"] = pr.decode_upload(upload.name, upload.getvalue())
            st.session_state["_uploaded"] = upload.file_id
        except pr.PromptError as err:
            st.sidebar.error(str(err))
    text = st.sidebar.text_area("Prompt text", key="prompt_text", height=220)
    st.sidebar.button("Run", key="run_btn", type="primary", help="Run the prompt through the model (Ctrl+Enter in "
                      "the box does the same). The views follow the selected layer.")
    n_tokens, span = 0, None
    try:
        tok_path = str(Path(path) / "tokenizer.json") if (Path(path) / "tokenizer.json").exists() else None
        ids, _ = pr.tokenize(text, tok_path) if text.strip() else ([], [])
        n_tokens = len(ids)
        tokenizer = f"{'checkpoint' if tok_path else 'project'} tokenizer"
        st.sidebar.caption(f"**{n_tokens:,} tokens** (with BOS) · {tokenizer}" if n_tokens else
                           f"**Empty prompt**: type one or pick a sample · {tokenizer}")
    except Exception as err:  # a broken tokenizer file must not take the page down
        fail("Could not tokenize the prompt", err)
    if st.sidebar.checkbox("Mark a token span as image positions", key="image_on",
                           help="Those positions route with the gate's bias_vl instead of bias."):
        raw = st.sidebar.text_input("Image span (start-end, end exclusive)", key="image_span",
                                    placeholder=f"e.g. 10-{min(40, max(n_tokens, 11))}")
        try:
            span = pr.parse_span(raw, n_tokens)
        except pr.PromptError as err:
            st.sidebar.error(str(err))
    return text, span


def on_sample(texts: dict) -> None:
    picked = st.session_state.get("sample")
    if picked in texts:
        st.session_state["prompt_text"] = texts[picked]
