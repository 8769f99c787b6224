"""The sidebar's model source and prompt."""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from explorer import prompt as pr
from explorer.screens.common import fail


def sidebar():
    """Model source and prompt. Returns (source, cfg_path, prompt text, image span or None)."""
    st.sidebar.markdown("### Model")
    default = os.environ.get("EXPLORER_SOURCE") or st.query_params.get("source") or pr.SOURCE_SHIPPED
    options = [pr.SOURCE_SHIPPED, pr.SOURCE_PATH, pr.SOURCE_CONFIG]
    if "source" not in st.session_state:
        st.session_state["source"] = default if default in options else pr.SOURCE_SHIPPED
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
        st.session_state.setdefault("ckpt_path", os.environ.get("EXPLORER_CHECKPOINT", ""))
        path = st.sidebar.text_input("Checkpoint folder", key="ckpt_path", placeholder="/data/v41-flash", help="A release-layout folder: config.json, "
                                     "model.safetensors.index.json and its shards.").strip()
        if not path:
            st.sidebar.caption("Enter a folder; until then the release config is shown.")
            path = str(pr.RELEASE_CONFIG)
    else:
        path = str(pr.RELEASE_CONFIG)
        st.sidebar.caption("Plan, diagram and tallies from assets/configs/v41-flash.json. No weights are loaded.")

    st.sidebar.markdown("### Prompt")
    samples = pr.sample_prompts()
    titles = {s.id: s.title for s in samples}
    pick = st.sidebar.selectbox("Sample", [s.id for s in samples], format_func=titles.get, key="sample",
                                on_change=lambda: st.session_state.update(
                                    prompt_text=next(s.text for s in samples if s.id == st.session_state["sample"])))
    if "prompt_text" not in st.session_state:
        st.session_state["prompt_text"] = next((s.text for s in samples if s.id == pick), "")
    upload = st.sidebar.file_uploader("…or upload a text file", type=["txt", "md", "py", "json", "csv"],
                                      key="upload")
    if upload is not None and st.session_state.get("_uploaded") != upload.file_id:
        try:
            st.session_state["prompt_text"] = pr.decode_upload(upload.name, upload.getvalue())
            st.session_state["_uploaded"] = upload.file_id
        except pr.PromptError as err:
            st.sidebar.error(str(err))
    text = st.sidebar.text_area("Prompt text", key="prompt_text", height=220)
    n_tokens, span = 0, None
    try:
        tok_path = str(Path(path) / "tokenizer.json") if (Path(path) / "tokenizer.json").exists() else None
        ids, _ = pr.tokenize(text, tok_path) if text.strip() else ([], [])
        n_tokens = len(ids)
        st.sidebar.caption(f"**{n_tokens:,} tokens** (with BOS) · "
                           f"{'checkpoint' if tok_path else 'project'} tokenizer")
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
    return source, path, text, span
