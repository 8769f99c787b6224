"""The sessions screens: the sidebar's save / search / open / import, the open session's panel
(share link, replay, duplicate, export, rename, delete with undo) and their callbacks."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import streamlit as st

from explorer import chart_titles as ct, run_plan, session_view as sv
from explorer.screens.common import cached_engine, cpu_refusal, set_view, view
from explorer.screens.serving_plan import session_settings as plan_session_settings
from explorer.session_compare import replay_report
from explorer.sessions import SessionConflict, SessionError, SessionNotFound, SessionStore, StoreUnavailable


@st.cache_resource(show_spinner="Opening the session database…")
def open_store(db_url: str, db_path: str):
    """(store, None), or (None, why): one store per database and process. A failure is remembered
    until "Retry", so a dead database server does not stall every rerun."""
    try:
        return SessionStore.from_env({"EXPLORER_DB_URL": db_url, "EXPLORER_DB_PATH": db_path}), None
    except SessionError as err:
        return None, str(err)
    except Exception as err:   # a missing driver or the like: still one line for the user
        print(traceback.format_exc())
        return None, f"The session database cannot be opened: {err}"


def cached_store():
    """The store named by EXPLORER_DB_URL (PostgreSQL) or EXPLORER_DB_PATH (SQLite; default path)."""
    return open_store(os.environ.get("EXPLORER_DB_URL", ""), os.environ.get("EXPLORER_DB_PATH", ""))


def flash(kind: str, text: str) -> None:
    """A message for the top of the page on the next draw (callbacks run before the page)."""
    st.session_state.setdefault("session_msgs", []).append((kind, text))
    redraw_page()


def redraw_page() -> None:
    """After a session action from inside the `analysis` fragment: draw the whole page next (the
    sidebar's session list, the messages), not only the fragment."""
    st.session_state["_full_rerun"] = True


def show_session(session) -> None:
    """Put a session's prompt, marks and settings into the widgets; its layer and tab follow in
    main() once the plan is known."""
    st.session_state["open_session"] = session
    st.session_state.update(sv.widget_state(session))
    values, note = sv.source_state(session, lambda folder: Path(folder).is_dir())
    st.session_state.update(values)
    if note:
        flash("info", note)
    st.session_state["_restore_view"] = True
    redraw_page()
    for key in ("replay", "_confirm_delete"):
        st.session_state.pop(key, None)


def open_session(session_id: str) -> None:
    store, why = cached_store()
    if store is None:
        flash("error", f"Cannot open the session: {why}")
        return
    try:
        show_session(store.load(session_id))
    except SessionNotFound as err:
        flash("warning", f"{err} The current view is unchanged.")
    except SessionError as err:
        flash("error", f"Cannot open the session: {err}")


def close_session() -> None:
    redraw_page()
    st.session_state.pop("open_session", None)
    st.session_state.pop("replay", None)
    set_view(sv.with_session(view(), None))


def current_data(name: str, author: str, notes: str):
    """SessionData of what is on screen (stashed by main() on every draw)."""
    a = st.session_state["_analysis"]
    origin = a["origin"] or {}
    return sv.build_session_data(
        name=name, author=author, notes=notes, view=a["view"], role=a["role"], source_kind=a["source"],
        model_source=origin.get("source") or a["path"], model_identity=origin.get("identity", ""),
        engine_version=origin.get("engine_version", ""), prompt=a["text"], span=a["span"],
        settings={k: st.session_state.get(k) for k in sv.SETTING_KEYS}, run=a["run"],
        prompt_b=st.session_state.get("cmp_prompt") if st.session_state.get("cmp_mode") == "prompt" else None,
        plan_settings=plan_session_settings())


def on_save() -> None:
    store, why = cached_store()
    try:
        data = current_data(st.session_state.get("save_name", ""), st.session_state.get("save_author", ""),
                            st.session_state.get("save_notes", ""))
        if store is None:
            raise StoreUnavailable(why)
        saved = store.save(data)
    except StoreUnavailable as err:
        flash("error", f"Not saved: {err} Export the analysis as JSON from the sidebar instead.")
        return
    except SessionError as err:
        flash("error", f"Not saved: {err}")
        return
    st.session_state["open_session"] = saved
    set_view(sv.with_session(view(), saved.id))
    flash("success", f"Saved session “{saved.name}”. Share the link below.")


def on_import() -> None:
    upload = st.session_state.get("session_import")
    if upload is None:
        return
    session, problem = sv.import_upload(cached_store()[0], upload.name, upload.getvalue())
    if problem:
        flash("error", problem)
        return
    show_session(session)
    flash("success", f"Imported “{session.name}” as a new session.")


def on_edit(session_id: str, revision: int) -> None:
    store, _ = cached_store()
    try:
        session = store.update(session_id, expected_revision=revision, name=st.session_state.get("edit_name", ""),
                               notes=st.session_state.get("edit_notes", ""))
    except SessionConflict as err:
        flash("warning", str(err))
        session = None
    except SessionError as err:
        flash("error", f"Not changed: {err}")
        return
    if session is None:
        try:
            session = store.load(session_id)
        except SessionError as err:
            flash("error", str(err))
            return
    else:
        flash("success", "Saved the name and notes.")
    st.session_state["open_session"] = session


def on_duplicate(session_id: str) -> None:
    store, _ = cached_store()
    try:
        copy = store.duplicate(session_id)
    except SessionError as err:
        flash("error", f"Not duplicated: {err}")
        return
    show_session(copy)
    flash("success", f"Made a copy: “{copy.name}” (its own link).")


def on_delete(session_id: str) -> None:
    store, _ = cached_store()
    try:
        store.delete(session_id)
    except SessionError as err:
        flash("error", f"Not deleted: {err}")
        return
    name = st.session_state["open_session"].name
    close_session()
    st.session_state["_deleted"] = (session_id, name)


def on_undo_delete() -> None:
    session_id, _ = st.session_state.pop("_deleted")
    store, _ = cached_store()
    try:
        show_session(store.restore(session_id))
    except SessionError as err:
        flash("error", f"Cannot restore: {err}")


def show_flashes() -> None:
    for kind, text in st.session_state.pop("session_msgs", []):
        getattr(st, kind)(sv.md_escape(text))     # messages quote names, ids and files: user text
    deleted = st.session_state.get("_deleted")
    if deleted:
        a, b = st.columns([5, 1])
        a.info(sv.md_escape(f"Deleted the session “{deleted[1]}”; its link no longer opens."))
        b.button("Undo delete", on_click=on_undo_delete, key="undo_delete")


def replay(session, source: str, path: str) -> None:
    """Re-run the stored prompt on the loaded model and keep the report for this session."""
    folder = run_plan.weights_folder(source, path)
    if folder is None:
        st.info("Replay needs model weights: pick the shipped model or a checkpoint folder in the sidebar.")
        return
    if not session.probes or not session.prompts:
        st.info("This session stored no probes, so there is nothing to replay against.")
        return
    span = sv.image_span(session.spans)
    refusal = cpu_refusal(source, path)
    if refusal:
        st.info(refusal)
        return
    try:
        engine = cached_engine(str(folder))
        with st.spinner("Replaying the stored prompt…"):
            new = engine.run(session.prompts[0], layers=sv.replay_layers(session),
                             image_spans=[span] if span else []).to_json()
    except Exception as err:   # EngineError messages are written for users
        print(traceback.format_exc())
        st.error(sv.md_escape(f"The replay failed: {err}"))
        return
    st.session_state["replay"] = (session.id, sv.replay_view(replay_report(session.probes, new)),
                                  sv.identity_note(session, engine.identity))


def session_panel(source: str, path: str) -> None:
    """The open session: who and what, its share link, and its actions (main page, under the title)."""
    session = st.session_state.get("open_session")
    if session is None:
        return
    with st.container(border=True, key="session_panel"):
        left, right = st.columns([1.5, 1], gap="medium")
        with left:
            st.markdown(f"**Session:** {sv.md_escape(session.name)}")
            st.caption(sv.md_escape(sv.session_caption(session)))
            if session.notes.strip():
                st.container(key="session_notes").markdown(sv.notes_markdown(session.notes))
            origin = st.session_state.get("run_origin") or {}
            if origin.get("stored"):
                st.caption("The layer views show the session's stored probes (no model run). Replay re-runs them.")
        with right:
            st.code(sv.share_link(app_url(), session.id), language=None, wrap_lines=True)
        with st.container(horizontal=True, key="session_actions"):
            replay_clicked = st.button("Replay", key="replay_btn", type="primary", help="Re-run the stored prompt on "
                                       "the loaded model and check that selections, mixing and routing come out "
                                       "identical.")
            st.button("Duplicate", key="dup_btn", on_click=on_duplicate, args=(session.id,))
            st.download_button("Export JSON", session_export(session), sv.export_filename(session.name, session.id),
                               "application/json", key="export_btn", on_click="ignore")
            with st.popover("Rename / notes"):
                st.text_input("Name", value=session.name, key="edit_name")
                st.text_area("Notes", value=session.notes, key="edit_notes", height=120)
                st.button("Save changes", key="edit_save", on_click=on_edit, args=(session.id, session.revision))
            if st.button("Delete…", key="delete_btn"):
                st.session_state["_confirm_delete"] = session.id
            st.button("Close", key="close_btn", on_click=close_session)
        if replay_clicked:
            replay(session, source, path)
        if st.session_state.get("_confirm_delete") == session.id:
            st.warning(sv.md_escape(f"Delete the session “{session.name}” for everyone? Its link stops working."))
            a, b, _ = st.columns([1, 1, 4])
            a.button("Yes, delete", key="delete_yes", type="primary", on_click=on_delete, args=(session.id,))
            b.button("Cancel", key="delete_no", on_click=lambda: st.session_state.pop("_confirm_delete", None))
        shown = st.session_state.get("replay")
        if shown and shown[0] == session.id:
            _, result, note = shown
            if note:
                st.warning(sv.md_escape(note))
            (st.success if result.identical else st.warning)(result.headline)
            if result.lines:
                st.code("\n".join(result.lines), language=None)


def session_export(session) -> str:
    store, _ = cached_store()
    try:
        return store.export_json(session.id)
    except SessionError:
        return sv.export_document(session.data())


def app_url() -> str:
    try:
        return (st.context.url or "").split("?")[0]
    except Exception:   # no browser context (AppTest)
        return ""


def sessions_sidebar() -> None:
    """Save, search, open and import team sessions (sidebar, under the prompt)."""
    st.sidebar.markdown("### Sessions")
    store, why = cached_store()
    if store is None:
        st.sidebar.error(sv.md_escape(f"Team sessions are unavailable: {why}"))
        st.sidebar.download_button("Export this analysis (JSON)", current_export(), f"{current_export_name()}.json",
                                   "application/json", key="export_current", on_click="ignore")
        st.sidebar.button("Retry the database", key="store_retry", on_click=open_store.clear)
        return
    st.sidebar.caption(sv.md_escape(f"Shared with the team in {store.describe()}."))
    damaged_notice = st.sidebar.empty()    # filled from the listing below, but shown with the expanders closed
    with st.sidebar.expander("Save this analysis"):
        with st.form("save_form", border=False):
            st.text_input("Name", key="save_name", max_chars=200, placeholder="Copy heads at layer 24")
            st.text_input("Author", key="save_author", max_chars=100)
            st.text_area("Notes", key="save_notes", height=90)
            st.form_submit_button("Save session", type="primary", on_click=on_save)
    with st.sidebar.expander("Open a team session", expanded=bool(st.session_state.get("session_query"))):
        query = st.text_input("Search", key="session_query", placeholder="name, author, prompt text, layer:24")
        try:
            found = store.list_sessions(query, limit=50)
        except SessionError as err:
            st.error(sv.md_escape(str(err)))
            found = []
        damaged = sv.damaged_sessions_warning(getattr(found, "damaged", ()))
        if damaged:
            damaged_notice.warning(sv.md_escape(damaged), icon=":material/warning:")
        if found:
            labels = {s.id: sv.summary_label(s) for s in found}
            pick = st.selectbox("Session", list(labels), format_func=labels.get, key="session_pick")
            st.button("Open", key="session_open", on_click=open_session, args=(pick,))
        else:
            st.caption("No session matches." if query.strip() else "No sessions saved yet.")
        st.file_uploader("Import a session file", type=["json"], key="session_import", on_change=on_import)


def current_export_name() -> str:
    """The unsaved analysis's file name: model, layer and the prompt's hash (issue 14)."""
    a = st.session_state.get("_analysis") or {}
    layer = a["view"].layer if a.get("view") is not None else None
    return ct.ChartName("analysis", ct.model_label(a.get("source"), a.get("path")), layer,
                        prompt=a.get("text") or None).file


def current_export() -> str:
    try:
        return sv.export_document(current_data("Unsaved analysis", "unknown", ""))
    except Exception as err:
        return json.dumps({"error": f"cannot export: {err}"})
