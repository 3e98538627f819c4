"""nodeagent — see DESIGN.md."""
