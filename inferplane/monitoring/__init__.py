"""What Prometheus and Grafana read: alert and recording rules, dashboards (generated, never hand-kept)."""
