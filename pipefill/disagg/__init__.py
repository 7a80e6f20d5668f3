"""Prefill/decode disaggregation: the KV transfer plane (DESIGN.md section 7).

messages.py   typed control messages (msgspec, msgpack, decoded against a schema, optional HMAC)
channel.py    length-prefixed frames over one TCP socket
rooms.py      pure state machines of rooms on both sides (timeouts, heartbeats, releases)
bootstrap.py  the bootstrap service on the prefill node, stage registration, decode look-up
transfer.py   KVTensors, Timing, the data-path choice; transfer_sender.py: KVSender (prefill
              stage), transfer_receiver.py: KVReceiver (decode stage); data paths:
transfer_tcp.py (two-sided, plain sockets) or transfer_mooncake.py (one-sided writes)
"""
