"""controller — see DESIGN.md."""
