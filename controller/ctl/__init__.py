"""`controllerctl`: one module per subcommand; imports nothing from controller.live."""
