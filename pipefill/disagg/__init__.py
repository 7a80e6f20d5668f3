"""Prefill/decode disaggregation: the KV transfer plane (ARCHITECTURE.md, 'Prefill/decode
disaggregation').

messages.py   typed control messages (msgspec, msgpack, decoded against a schema, optional HMAC)
channel.py    length-prefixed frames over one TCP socket, listeners; handshake.py: the
              secret handshake, session keys and MACs
rooms.py      pure state machines of rooms: prefill_rooms.py and decode_rooms.py (timeouts,
              heartbeats, releases), with the liveness and expiry pieces both share in rooms.py
bootstrap.py  the bootstrap service on the prefill node, stage registration, decode look-up
heads.py      which KV heads each TP rank of a stage holds, and how a decode rank's are cut out of
              the prefill ranks'
transfer.py   KVTensors (one TP rank's), StageTensors (a stage's ranks), Timing, the data-path
              choice; transfer_sender.py: KVSender (prefill stage), transfer_receiver.py:
              KVReceiver (decode stage); data paths: transfer_tcp.py (two-sided, plain
              sockets) or transfer_mooncake.py (one-sided writes)
"""
