"""Reaching hosts from the controller: the inventory, parallel SSH sessions, tunnels."""
