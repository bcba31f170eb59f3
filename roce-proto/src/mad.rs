//! Management datagrams (MADs) as RoCEv2 carries them: UD SEND ONLY packets to
//! QP1 (the General Services Interface) whose 256-byte payload starts with the
//! MAD common header (IBTA vol. 1 13.4.2). rdma_cm and `perftest -R` set up
//! their RC connections with Communication Management MADs (class 0x07, IBTA
//! 12.6): this names them, so a capture of any stack reads as what it did.

use crate::{Opcode, Packet};

/// The QP that receives General Services MADs (IBTA 13.5.1.1).
pub const GSI_QP: u32 = 1;

/// Management class of Communication Management.
pub const CM_CLASS: u8 = 0x07;

/// The MAD common header (IBTA 13.4.2, table 144), 24 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MadHeader {
    /// BaseVersion (1).
    pub base_version: u8,
    /// MgmtClass (0x07: CM).
    pub mgmt_class: u8,
    /// ClassVersion (CM: 2).
    pub class_version: u8,
    /// Method, with the response bit (bit 7).
    pub method: u8,
    /// Status.
    pub status: u16,
    /// Transaction ID.
    pub transaction_id: u64,
    /// AttributeID: what the MAD carries.
    pub attribute_id: u16,
    /// AttributeModifier.
    pub attribute_modifier: u32,
}

impl MadHeader {
    /// Length of the common header.
    pub const LEN: usize = 24;

    /// Parse the common header at the start of `b`.
    pub fn parse(b: &[u8]) -> Option<MadHeader> {
        let h = b.get(..Self::LEN)?;
        Some(MadHeader {
            base_version: h[0],
            mgmt_class: h[1],
            class_version: h[2],
            method: h[3],
            status: u16::from_be_bytes([h[4], h[5]]),
            transaction_id: u64::from_be_bytes(h[8..16].try_into().ok()?),
            attribute_id: u16::from_be_bytes([h[16], h[17]]),
            attribute_modifier: u32::from_be_bytes(h[20..24].try_into().ok()?),
        })
    }
}

/// The name of a CM attribute (IBTA 12.6.1, table 99: the CM messages).
pub fn cm_message_name(attribute_id: u16) -> Option<&'static str> {
    Some(match attribute_id {
        0x0010 => "ConnectRequest",
        0x0011 => "MsgRcptAck",
        0x0012 => "ConnectReject",
        0x0013 => "ConnectReply",
        0x0014 => "ReadyToUse",
        0x0015 => "DisconnectRequest",
        0x0016 => "DisconnectReply",
        0x0017 => "ServiceIDResReq",
        0x0018 => "ServiceIDResReqResp",
        0x0019 => "LoadAlternatePath",
        0x001A => "AlternatePathResponse",
        0x0001 => "ClassPortInfo",
        _ => return None,
    })
}

/// The MAD a packet carries: a UD SEND to QP1 with a MAD header.
pub fn mad_of(p: &Packet) -> Option<MadHeader> {
    let ud = matches!(
        p.bth.opcode,
        Opcode::UD_SEND_ONLY | Opcode::UD_SEND_ONLY_WITH_IMMEDIATE
    );
    if !ud || p.bth.dest_qp != GSI_QP {
        return None;
    }
    MadHeader::parse(&p.payload).filter(|h| h.base_version == 1)
}

/// "CM ConnectRequest" and the like for a CM MAD, "MAD class 0x.." for
/// another management class; `None` if the packet is not a MAD.
pub fn describe(p: &Packet) -> Option<String> {
    let h = mad_of(p)?;
    Some(match (h.mgmt_class, cm_message_name(h.attribute_id)) {
        (CM_CLASS, Some(name)) => format!("CM {name}"),
        (CM_CLASS, None) => format!("CM attribute {:#06x}", h.attribute_id),
        (class, _) => format!("MAD class {class:#04x}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Bth, Deth};
    use bytes::Bytes;

    fn ud_to(qp: u32, payload: Vec<u8>) -> Packet {
        let mut p = Packet::new(Bth::new(Opcode::UD_SEND_ONLY, qp, 5));
        p.deth = Some(Deth {
            qkey: 0x8001_0000,
            resv8: 0,
            src_qp: 1,
        });
        p.payload = Bytes::from(payload);
        p.finish();
        p
    }

    fn cm_mad(attr: u16) -> Vec<u8> {
        let mut m = vec![0u8; 256];
        m[..4].copy_from_slice(&[1, CM_CLASS, 2, 0x03]);
        m[8..16].copy_from_slice(&0x1122_3344_5566_7788u64.to_be_bytes());
        m[16..18].copy_from_slice(&attr.to_be_bytes());
        m
    }

    #[test]
    fn names_cm_messages_on_qp1_only() {
        let p = ud_to(GSI_QP, cm_mad(0x0010));
        let h = mad_of(&p).unwrap();
        assert_eq!((h.mgmt_class, h.method), (CM_CLASS, 3));
        assert_eq!(h.transaction_id, 0x1122_3344_5566_7788);
        assert_eq!(describe(&p).as_deref(), Some("CM ConnectRequest"));
        assert_eq!(
            describe(&ud_to(GSI_QP, cm_mad(0x0014))).as_deref(),
            Some("CM ReadyToUse")
        );
        assert_eq!(
            describe(&ud_to(GSI_QP, cm_mad(0x7777))).as_deref(),
            Some("CM attribute 0x7777")
        );
        // Not QP1, too short, or not a MAD: nothing.
        assert_eq!(describe(&ud_to(0x20, cm_mad(0x0010))), None);
        assert_eq!(describe(&ud_to(GSI_QP, vec![1, 7, 2])), None);
        let mut m = cm_mad(0x0010);
        m[0] = 9;
        assert_eq!(describe(&ud_to(GSI_QP, m)), None);
    }
}
