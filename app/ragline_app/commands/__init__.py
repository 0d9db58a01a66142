"""The `ragline` command's subcommands, one module each (`register` adds its parser and
sets the function it runs); `ragline_app.cli` puts them together."""
