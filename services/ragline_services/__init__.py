"""The ragline services, one package each (installed as `ragline_services`)."""
