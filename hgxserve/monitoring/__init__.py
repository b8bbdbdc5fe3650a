"""Monitoring rendered from the topology: Prometheus scrape jobs and file_sd targets, recording
and alert rules, a Grafana dashboard, the DCGM exporter's counters (docs/monitoring.md)."""
