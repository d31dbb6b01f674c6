"""Runbooks, one Markdown file per alert; shipped as package data so the agent can serve them."""
