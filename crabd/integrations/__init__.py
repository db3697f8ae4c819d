"""Adapters that tie agent frameworks' own state to crabd's sandbox state.

`crabd.integrations.langgraph`: a LangGraph checkpoint saver that records the
sandbox's crabd checkpoint with every graph checkpoint (needs the `langgraph`
extra: `pip install 'crabd[langgraph]'`).
"""
