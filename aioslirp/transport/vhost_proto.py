"""The vhost-user protocol's numbers (docs: QEMU's ``docs/interop/vhost-user.rst``; virtio 1.1 5.1.3,
6): the virtio-net and protocol feature bits, what :class:`~aioslirp.transport.vhost_user.VhostUserTransport`
offers, the front end's message codes and the wire layouts of their payloads. Data only."""

from __future__ import annotations

import struct

__all__ = ["OFFERED_FEATURES", "OFFERED_PROTOCOL_FEATURES", "NAMES"]

# -- virtio-net / vhost-user feature bits (virtio 1.1 5.1.3, 6; vhost-user.rst) -------------------
F_CSUM = 1 << 0
F_GUEST_CSUM = 1 << 1
F_GUEST_TSO4 = 1 << 7
F_GUEST_TSO6 = 1 << 8
F_HOST_TSO4 = 1 << 11
F_HOST_TSO6 = 1 << 12
F_MRG_RXBUF = 1 << 15
F_EVENT_IDX = 1 << 29
F_PROTOCOL_FEATURES = 1 << 30
F_VERSION_1 = 1 << 32

#: What the device offers (GET_FEATURES).
OFFERED_FEATURES = (F_CSUM | F_GUEST_CSUM | F_GUEST_TSO4 | F_GUEST_TSO6 | F_HOST_TSO4 | F_HOST_TSO6 | F_MRG_RXBUF
                    | F_EVENT_IDX | F_PROTOCOL_FEATURES | F_VERSION_1)

P_REPLY_ACK = 1 << 3
#: The protocol features offered (GET_PROTOCOL_FEATURES).
OFFERED_PROTOCOL_FEATURES = P_REPLY_ACK

# -- messages (front end -> back end) ---------------------------------------------------------
GET_FEATURES = 1
SET_FEATURES = 2
SET_OWNER = 3
RESET_OWNER = 4
SET_MEM_TABLE = 5
SET_LOG_BASE = 6
SET_LOG_FD = 7
SET_VRING_NUM = 8
SET_VRING_ADDR = 9
SET_VRING_BASE = 10
GET_VRING_BASE = 11
SET_VRING_KICK = 12
SET_VRING_CALL = 13
SET_VRING_ERR = 14
GET_PROTOCOL_FEATURES = 15
SET_PROTOCOL_FEATURES = 16
GET_QUEUE_NUM = 17
SET_VRING_ENABLE = 18
SEND_RARP = 19
NET_SET_MTU = 20

NAMES = {v: k for k, v in globals().items() if k.isupper() and k[:4] in ("GET_", "SET_", "RESE", "SEND", "NET_")
         and isinstance(v, int)}

#: ``request, flags, size`` (little-endian, vhost-user.rst "Header").
HEADER = struct.Struct("<III")
VERSION = 0x1
FLAG_REPLY = 0x4
FLAG_NEED_REPLY = 0x8
#: Largest payload accepted (SET_MEM_TABLE with 8 regions is 264 bytes; the spec's largest, the
#: config space, 268): beyond it the front end is cut off.
MAX_PAYLOAD = 4096
#: Most fds taken with one message (one per region; QEMU sends at most 8).
MAX_FDS = 32
#: The device's TX moderation threshold by default, in bytes (``VhostUserTransport(tx_coalesce=)``,
#: ``aioslirp vhost-user --tx-coalesce``): a walk of the TX ring that took this much asks for no kick.
TX_COALESCE = 32 * 1024
#: Seconds a small TX walk's completion call may wait by default (``VhostUserTransport(tx_defer=)``,
#: ``aioslirp vhost-user --tx-defer``): the guest may take its buffers back without it.
TX_DEFER = 0.001
U64 = struct.Struct("<Q")
VRING_STATE = struct.Struct("<II")
VRING_ADDR = struct.Struct("<IIQQQQ")
MEM_HEADER = struct.Struct("<II")
MEM_REGION = struct.Struct("<QQQQ")
VRING_NOFD = 0x100
VRING_INDEX = 0xFF

RX, TX = 0, 1
