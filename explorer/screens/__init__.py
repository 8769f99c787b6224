"""The explorer's Streamlit screens (app.py wires them): common helpers, sidebar, live views,
sessions, side by side."""
