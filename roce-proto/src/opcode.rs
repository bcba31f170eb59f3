//! BTH opcodes and which extension headers each carries (rocev2-reference §3;
//! IBTA vol. 1 9.2.3 table 38): RC (what the engine speaks), and UC and UD so
//! that captures from any stack decode (`rdmx pcap check`).

use std::fmt;

/// A BTH opcode: bits 7:5 transport (000 = RC), bits 4:0 operation.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Opcode(pub u8);

/// Extension headers that follow the BTH, in wire order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// Datagram extended transport header (8 bytes, UD only; first after the BTH).
    pub deth: bool,
    /// RDMA extended transport header (16 bytes).
    pub reth: bool,
    /// Atomic extended transport header (28 bytes).
    pub atomic_eth: bool,
    /// ACK extended transport header (4 bytes).
    pub aeth: bool,
    /// Atomic acknowledge header (8 bytes).
    pub atomic_ack_eth: bool,
    /// Immediate data (4 bytes).
    pub imm: bool,
    /// Invalidate extended transport header (4 bytes).
    pub ieth: bool,
    /// The 16 reserved bytes of a CNP.
    pub cnp: bool,
    /// Whether a payload may follow the headers.
    pub payload: bool,
}

impl Layout {
    /// Bytes of extension headers after the 12-byte BTH.
    pub fn ext_len(&self) -> usize {
        8 * self.deth as usize
            + 16 * self.reth as usize
            + 28 * self.atomic_eth as usize
            + 4 * self.aeth as usize
            + 8 * self.atomic_ack_eth as usize
            + 4 * self.imm as usize
            + 4 * self.ieth as usize
            + 16 * self.cnp as usize
    }
}

macro_rules! opcodes {
    ($($name:ident = $v:expr, $text:expr, [$($h:ident),*], $payload:expr;)*) => {
        impl Opcode {
            $(#[doc = $text] pub const $name: Opcode = Opcode($v);)*

            /// The opcode's name as the reference spells it, if known.
            pub fn name(self) -> Option<&'static str> {
                match self.0 { $($v => Some(stringify!($name)),)* _ => None }
            }

            /// Header layout, or `None` for an opcode this codec does not know.
            pub fn layout(self) -> Option<Layout> {
                match self.0 {
                    $($v => Some(Layout { $($h: true,)* payload: $payload, ..Layout::default() }),)*
                    _ => None,
                }
            }

            /// Every opcode this codec knows.
            pub const ALL: &'static [Opcode] = &[$(Opcode::$name),*];
        }
    };
}

opcodes! {
    SEND_FIRST = 0x00, "RC SEND first packet.", [], true;
    SEND_MIDDLE = 0x01, "RC SEND middle packet.", [], true;
    SEND_LAST = 0x02, "RC SEND last packet.", [], true;
    SEND_LAST_WITH_IMMEDIATE = 0x03, "RC SEND last packet with immediate.", [imm], true;
    SEND_ONLY = 0x04, "RC SEND only packet.", [], true;
    SEND_ONLY_WITH_IMMEDIATE = 0x05, "RC SEND only packet with immediate.", [imm], true;
    RDMA_WRITE_FIRST = 0x06, "RC RDMA WRITE first packet.", [reth], true;
    RDMA_WRITE_MIDDLE = 0x07, "RC RDMA WRITE middle packet.", [], true;
    RDMA_WRITE_LAST = 0x08, "RC RDMA WRITE last packet.", [], true;
    RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09, "RC RDMA WRITE last packet with immediate.", [imm], true;
    RDMA_WRITE_ONLY = 0x0A, "RC RDMA WRITE only packet.", [reth], true;
    RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B, "RC RDMA WRITE only packet with immediate.", [reth, imm], true;
    RDMA_READ_REQUEST = 0x0C, "RC RDMA READ request.", [reth], false;
    RDMA_READ_RESPONSE_FIRST = 0x0D, "RC RDMA READ response first packet.", [aeth], true;
    RDMA_READ_RESPONSE_MIDDLE = 0x0E, "RC RDMA READ response middle packet (no AETH).", [], true;
    RDMA_READ_RESPONSE_LAST = 0x0F, "RC RDMA READ response last packet.", [aeth], true;
    RDMA_READ_RESPONSE_ONLY = 0x10, "RC RDMA READ response only packet.", [aeth], true;
    ACKNOWLEDGE = 0x11, "RC ACK or NAK.", [aeth], false;
    ATOMIC_ACKNOWLEDGE = 0x12, "RC atomic acknowledge.", [aeth, atomic_ack_eth], false;
    COMPARE_SWAP = 0x13, "RC compare-and-swap request.", [atomic_eth], false;
    FETCH_ADD = 0x14, "RC fetch-and-add request.", [atomic_eth], false;
    SEND_LAST_WITH_INVALIDATE = 0x16, "RC SEND last packet with invalidate.", [ieth], true;
    SEND_ONLY_WITH_INVALIDATE = 0x17, "RC SEND only packet with invalidate.", [ieth], true;
    UC_SEND_FIRST = 0x20, "UC SEND first packet.", [], true;
    UC_SEND_MIDDLE = 0x21, "UC SEND middle packet.", [], true;
    UC_SEND_LAST = 0x22, "UC SEND last packet.", [], true;
    UC_SEND_LAST_WITH_IMMEDIATE = 0x23, "UC SEND last packet with immediate.", [imm], true;
    UC_SEND_ONLY = 0x24, "UC SEND only packet.", [], true;
    UC_SEND_ONLY_WITH_IMMEDIATE = 0x25, "UC SEND only packet with immediate.", [imm], true;
    UC_RDMA_WRITE_FIRST = 0x26, "UC RDMA WRITE first packet.", [reth], true;
    UC_RDMA_WRITE_MIDDLE = 0x27, "UC RDMA WRITE middle packet.", [], true;
    UC_RDMA_WRITE_LAST = 0x28, "UC RDMA WRITE last packet.", [], true;
    UC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x29, "UC RDMA WRITE last packet with immediate.", [imm], true;
    UC_RDMA_WRITE_ONLY = 0x2A, "UC RDMA WRITE only packet.", [reth], true;
    UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x2B, "UC RDMA WRITE only packet with immediate.", [reth, imm], true;
    UD_SEND_ONLY = 0x64, "UD SEND only packet (also the CM MADs on QP1).", [deth], true;
    UD_SEND_ONLY_WITH_IMMEDIATE = 0x65, "UD SEND only packet with immediate.", [deth, imm], true;
    CNP = 0x81, "Congestion notification packet (rocev2-reference §10).", [cnp], false;
}

impl Opcode {
    /// True for RC packets a requester sends (SEND, WRITE, READ request, atomics).
    pub fn is_request(self) -> bool {
        self.0 <= 0x0C || self.0 == 0x13 || self.0 == 0x14 || self.0 == 0x16 || self.0 == 0x17
    }

    /// True for RC RDMA READ response packets (FIRST, MIDDLE, LAST, ONLY).
    pub fn is_read_response(self) -> bool {
        (0x0D..=0x10).contains(&self.0)
    }

    /// The transport: bits 7:5 of the opcode (IBTA 9.2.3).
    pub fn transport(self) -> Transport {
        match self.0 >> 5 {
            0 => Transport::Rc,
            1 => Transport::Uc,
            2 => Transport::Rd,
            3 => Transport::Ud,
            4 => Transport::Cnp,
            5 => Transport::Xrc,
            _ => Transport::Reserved,
        }
    }
}

/// The transport an opcode belongs to (IBTA 9.2.3; 100b is RoCEv2's CNP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Reliable connection.
    Rc,
    /// Unreliable connection.
    Uc,
    /// Reliable datagram.
    Rd,
    /// Unreliable datagram.
    Ud,
    /// Congestion notification (RoCEv2 annex A17).
    Cnp,
    /// Extended reliable connection.
    Xrc,
    /// Reserved.
    Reserved,
}

impl fmt::Debug for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}({:#04x})", self.0),
            None => write!(f, "Opcode({:#04x})", self.0),
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "unknown({:#04x})", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lengths_match_reference() {
        assert_eq!(
            Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE
                .layout()
                .unwrap()
                .ext_len(),
            20
        );
        assert_eq!(Opcode::ATOMIC_ACKNOWLEDGE.layout().unwrap().ext_len(), 12);
        assert_eq!(Opcode::COMPARE_SWAP.layout().unwrap().ext_len(), 28);
        assert_eq!(Opcode::CNP.layout().unwrap().ext_len(), 16);
        assert_eq!(
            Opcode::RDMA_READ_RESPONSE_MIDDLE
                .layout()
                .unwrap()
                .ext_len(),
            0
        );
        assert!(Opcode(0x15).layout().is_none());
        // 24 RC (with the CNP), 12 UC, 2 UD.
        assert_eq!(Opcode::ALL.len(), 38);
        assert_eq!(Opcode::UD_SEND_ONLY.layout().unwrap().ext_len(), 8);
        assert_eq!(
            Opcode::UD_SEND_ONLY_WITH_IMMEDIATE
                .layout()
                .unwrap()
                .ext_len(),
            12
        );
        assert_eq!(
            Opcode::UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE
                .layout()
                .unwrap()
                .ext_len(),
            20
        );
        assert_eq!(Opcode::UC_SEND_FIRST.transport(), Transport::Uc);
        assert_eq!(Opcode::UD_SEND_ONLY.transport(), Transport::Ud);
        assert_eq!(Opcode::CNP.transport(), Transport::Cnp);
        assert!(!Opcode::UC_SEND_ONLY.is_request());
        assert_eq!(format!("{:?}", Opcode::CNP), "CNP(0x81)");
    }
}
