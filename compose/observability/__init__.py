"""The Prometheus config, alert rules and Grafana dashboard: package data of kairos-gateway,
installed as ``kairos.observability`` (``kairos up`` writes them next to its targets file)."""
