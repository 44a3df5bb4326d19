"""The router: admits requests and picks prefill and decode workers from what they publish."""
