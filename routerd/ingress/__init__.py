"""The two ways in: HTTP (``ingress.http``) and the durable Redis queue (``ingress.queue``)."""
