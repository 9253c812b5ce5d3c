"""Chinese word lists the guards read: negation characters and the fixed words in which they do
not negate, antonym pairs, numerals, date words, audiences, question words and fillers.

Simplified Chinese, written from general knowledge of customer-service and technical questions
(not from any evaluation pair). Like :mod:`lexicon`, these are general-purpose lists, not a
dictionary: a pair they miss is left to the embedder and the calibrated threshold.
"""

from __future__ import annotations

#: Characters that negate what follows (不想, 没收到, 未支付, 别发, 无法, 非会员).
NEGATION_CHARS = "不没未别无非勿莫"

#: Fixed words in which a negation character does not negate the question: masked before the
#: cues are counted. Longest first is not needed: a mask is a plain substring replacement.
NOT_NEGATING = (
    "不锈钢", "不错", "差不多", "不停", "不动产", "固定不动", "不间断", "不久", "不过", "不管", "不仅", "不断", "不少",
    "不同", "不如", "不一定",
    "不得不", "要不要", "是不是", "能不能", "可不可以", "会不会", "有没有", "好不好", "对不对", "行不行",
    "用不用", "需不需要", "要不然", "不然", "忍不住", "来不及", "了不起", "对不起", "不好意思",
    # "A 了没有": has A happened yet? (发货了没有 = 发货了吗)
    "了没有", "了没",
    "非常", "非洲", "是非", "未来", "别人", "别的", "别处", "区别", "差别", "分别", "特别", "告别", "级别",
    "类别", "性别", "识别", "辨别", "个别", "鉴别", "别墅", "别名", "无论", "无线", "无人机", "无锡",
    "无所谓", "无糖", "无限", "毫无疑问", "莫名", "莫非", "未成年", "不一样", "非得", "没关系", "没事",
    # "I don't know how to ...": the question is the same without it
    "不知道", "不清楚", "不太清楚", "不太懂", "不懂", "不太会", "不会弄", "搞不懂", "弄不懂", "不明白",
)

#: Pairs of words asking opposite questions. Multi-character words are found as substrings;
#: single characters (开/关, 买/卖, ...) only as whole words of the segmentation.
ANTONYMS: tuple[tuple[str, str], ...] = (
    ("打开 开启 开通 启用 激活 开", "关闭 关掉 取消 停用 禁用 注销 关 退订"),
    ("上传", "下载"), ("制冷", "制热"), ("寄 寄出 寄件", "取 取件"), ("过高 偏高 太高", "过低 偏低 太低"),
    ("授予 赋予 开通 增加 添加 申请", "撤销 收回 撤回"),
    ("开机", "关机"), ("开灯", "关灯"), ("开户", "销户"), ("注册", "注销"), ("上线", "下线"), ("上架", "下架"),
    ("上一", "下一"), ("上次", "下次"), ("上个", "下个"), ("上半年", "下半年"), ("上半场", "下半场"),
    ("之前 以前", "之后 以后"), ("收藏", "取消收藏"), ("关注", "取消关注"), ("点赞", "取消点赞"),
    ("拉黑 屏蔽", "取消拉黑 解除拉黑 取消屏蔽 解除屏蔽"), ("静音", "取消静音"), ("置顶", "取消置顶"),
    ("备份", "恢复 还原"), ("压缩", "解压"), ("挂失", "解挂"), ("停机", "复机"), ("入库", "出库"), ("进站", "出站"),
    ("入住", "退房"), ("预订 预定 预约", "取消预订 取消预定 取消预约"), ("报名", "取消报名"), ("借书", "还书"),
    ("贷款", "还贷"), ("转入 汇入", "转出 汇出"), ("正常", "异常"), ("付款 支付", "退款"), ("充电", "放电"),
    ("加速", "减速"), ("加", "删"), ("补税 补缴", "退税"), ("产假", "陪产假"), ("升职", "降职"),
    ("加薪 涨工资", "降薪 扣工资"), ("增持", "减持"), ("买房", "卖房"),
    ("发货 收货 换货", "退货"), ("主动", "被动"), ("全职", "兼职"), ("长期", "短期"), ("单程", "往返"),
    ("直飞", "转机"), ("白班", "夜班"), ("定期", "活期"), ("线上", "线下"), ("在线", "离线"), ("正版", "盗版"),
    ("整租", "合租"), ("单人", "双人"), ("续费 续订 自动续费", "取消续费 取消自动续费 关闭自动续费 停止续费 停止自动续费"),
    ("涨", "跌"), ("赢 胜", "输 负"), ("真", "假"), ("正面", "反面"), ("前面", "后面"), ("左", "右"),
    ("东", "西"), ("南", "北"), ("男", "女"), ("贵", "便宜"), ("强", "弱"), ("厚", "薄"), ("深", "浅"),
    ("亮", "暗"), ("胖", "瘦"), ("干", "湿"), ("高", "低"), ("升级", "降级"),
    ("上调 调高 提高 增加 增多 加大 扩大 放大 涨", "下调 调低 降低 减少 减小 缩小 降"),
    ("上涨", "下跌"), ("冻结", "解冻"), ("正确", "错误"), ("交 缴 缴纳 征收", "免交 免缴 免征 免税"),
    ("绑定", "解绑 解除绑定"), ("锁定 加锁 上锁", "解锁 解除锁定"),
    ("登录 登陆 登入", "退出登录 登出 注销 退出"), ("加入 入群 入会 参加", "退出 退群 退会"), ("入职 在职", "离职"),
    ("所有 全部 整个 全体 全员", "单个 某个 某一个 其中一个"),
    ("充值 存入 存款 存钱", "提现 取出 取款 取钱"), ("收款 收钱", "付款 付钱"), ("收入", "支出"),
    ("买入 购买 买", "卖出 出售 卖"), ("借款 借钱 借", "还款 还钱 还"), ("进口", "出口"), ("入口", "出口"),
    ("导入", "导出"), ("发送 发出 寄出", "接收 收到 签收"), ("显示", "隐藏"), ("公开", "私密 隐私"),
    ("免费", "收费 付费"), ("加密", "解密"), ("安装", "卸载"), ("连接 连上", "断开"), ("订阅", "退订 取消订阅"),
    ("开始 启动", "结束 停止 终止"), ("暂停", "恢复 继续"), ("成功", "失败"), ("盈利 赚钱", "亏损 亏钱"),
    ("最高", "最低"), ("最多", "最少"), ("最大", "最小"), ("最早", "最晚 最迟"), ("最快", "最慢"),
    ("最好", "最差"), ("允许 可以 能", "禁止 不准 不许"), ("同意", "拒绝"), ("批准 通过", "驳回"),
    ("增值", "贬值"), ("提前", "推迟 延迟 延期"), ("涨价", "降价"), ("升温", "降温"), ("正数", "负数"),
    ("优点 好处", "缺点 坏处"), ("合法", "违法 非法"), ("安全", "危险"), ("上车", "下车"), ("上班", "下班"),
    ("出发", "到达"), ("出境", "入境"), ("出院", "住院"), ("插入", "拔出"), ("添加 新增", "删除 移除"), ("加入", "移出"),
    ("多", "少"), ("大", "小"), ("长", "短"), ("快", "慢"), ("早", "晚"), ("新", "旧"), ("冷", "热"),
    ("进", "出"), ("升", "降"), ("增", "减"),
)

#: Numerals and their values; 两 is 2. A lone 一 is not counted (一个, 一下, 一起 say "a", not 1).
DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7, "八": 8, "九": 9}
UNITS = {"十": 10, "百": 100, "千": 1000}
BIG_UNITS = {"万": 10**4, "亿": 10**8}
#: Words containing numerals that are not numbers: masked before numbers are read.
NOT_NUMBERS = (
    "百度", "三星", "一加", "万一", "千万", "十分", "百分百", "一些", "一下", "一直", "一起", "一样", "一般",
    "一定", "统一", "唯一", "一切", "一旦", "一边", "一致", "一共", "一律", "一点点", "一会", "一次性", "万能",
    "千万不要", "三明治", "五金", "四川", "三亚", "九寨沟", "七夕", "百货", "千克", "万事", "一键", "二维码",
    "十字路口", "一手", "二手", "三方", "第三方", "五险一金", "一卡通", "万达", "百事", "三国", "八卦",
    "两者", "两边", "两方", "一模一样", "乱七八糟", "十全十美", "三天两头", "一两", "一二", "万一", "千万别",
)
#: Measure words after which a lone 一 is the number 1 (一天 = 1天), not "a" (一个, 一下).
ONE_MEASURES = "天年月周次号点岁元块倍楼层张台件晚夜"

#: Words that say "the first" without a numeral (首行 = 第一行).
FIRST_WORDS = ("首次", "首行", "首列", "首页", "首单", "首月", "首年", "首日")

#: Dates and times named by words. Weekdays are read by pattern (周一, 星期三, 礼拜天).
DATE_WORDS = (
    "今天", "明天", "昨天", "后天", "前天", "今晚", "明晚", "昨晚", "今早", "明早", "今年", "明年", "去年",
    "前年", "后年", "本周", "下周", "上周", "这周", "本月", "下个月", "下月", "上个月", "上月", "这个月",
    "月初", "月底", "月末", "年初", "年底", "年末", "周末", "工作日", "节假日", "节日", "假期", "寒假", "暑假",
    "上午", "下午", "早上", "早晨", "清晨", "晚上", "中午", "傍晚", "凌晨", "半夜", "夜里", "夜间", "白天",
    "春节", "除夕", "元旦", "国庆", "中秋", "端午", "清明", "元宵", "劳动节", "五一", "双十一", "双十二", "圣诞",
    "春天", "夏天", "秋天", "冬天", "春季", "夏季", "秋季", "冬季",
)
#: How often: compared only when both texts say it (每月多少钱 asks what 月租多少 asks).
FREQUENCY_WORDS = {"每天": "daily", "每日": "daily", "每周": "weekly", "每星期": "weekly", "每月": "monthly",
                   "每个月": "monthly", "每年": "yearly", "每小时": "hourly"}
#: Spellings of the same date word.
DATE_ALIASES = {"早晨": "早上", "清晨": "早上", "每日": "每天", "春季": "春天", "夏季": "夏天", "秋季": "秋天",
                "冬季": "冬天", "下月": "下个月", "上月": "上个月", "这周": "本周", "这个月": "本月", "月末": "月底",
                "年末": "年底", "今早": "早上", "明早": "明天 早上", "今晚": "今天 晚上", "明晚": "明天 晚上",
                "昨晚": "昨天 晚上", "春节": "春节", "五一": "劳动节"}

#: Who a question is about or for: words in one group mean the same audience (as
#: :data:`lexicon.AUDIENCES`).
AUDIENCES: tuple[str, ...] = (
    "成人 成年人 大人", "儿童 孩子 小孩 小朋友", "婴儿 宝宝 新生儿 幼儿", "青少年 未成年", "老人 老年人 长辈 老年",
    "学生", "本科生 大学生", "研究生 硕士 博士", "小学生", "中学生 高中生 初中生", "老师 教师",
    "员工 职工 雇员", "老板 雇主 企业主", "个人", "企业 公司 单位", "个体户 个体工商户", "租客 租户 房客", "房东 业主",
    "新用户 新客户", "老用户 老客户", "男性 男士 男生", "女性 女士 女生", "孕妇 孕期", "病人 患者",
    "游客 访客", "全部 全额", "部分", "个人版", "家庭版", "专业版", "企业版", "教育版", "旗舰版", "标准版",
    "国内 境内", "国外 国际 海外 境外", "省内", "省外", "市内", "市外", "外地人 外地", "本地人 本地",
    "司机", "乘客", "家属 亲属", "朋友 好友", "卖家 商家", "买家", "外国人", "中国人",
)

#: Closed classes that fill a template's slot, compared when both texts name one (as
#: ``lexicon.SIZES``): colours (红色的 is not 黑色的), languages (改成英文 / 改成日文), spice levels.
COLOURS: tuple[str, ...] = ("红色 大红 酒红", "黑色", "白色", "蓝色 深蓝 浅蓝 天蓝", "绿色 墨绿", "黄色", "紫色",
                            "粉色 粉红 粉红色", "灰色 深灰 浅灰 深空灰 太空灰", "橙色 橘色", "棕色 咖啡色", "金色", "银色",
                            "米色 米白")
LANGUAGES: tuple[str, ...] = ("英文 英语", "中文 汉语 普通话", "日文 日语", "韩文 韩语", "法文 法语", "德文 德语",
                              "西班牙语 西语", "俄文 俄语", "粤语", "繁体", "简体")
#: Words that ask for one act, whichever is used (a frame's slot filled by either is one question).
SAME_ACT: tuple[str, ...] = ("取消 停止 停用 关闭 关掉 退订", "开通 开启 打开 启用", "删除 删掉 清除", "修改 更改 更换",
                            "查询 查看 查", "丢 丢失 弄丢 遗失", "设置 设定", "退款 退钱", "付款 支付 付钱")
ROOMS: tuple[str, ...] = ("大床房 大床间", "双床房 双床间 标间 标准间", "单人间 单人房", "双人间 双人房", "三人间",
                         "套房 套间", "家庭房 亲子房")
PAYMENTS: tuple[str, ...] = ("现金", "刷卡 银行卡 信用卡 借记卡", "转账 汇款", "代扣 自动扣款 自动扣费", "支票")
SPICE: tuple[str, ...] = ("不辣 免辣", "微辣", "中辣", "特辣 重辣 变态辣")
APPLIANCES: tuple[str, ...] = ("烤箱", "微波炉", "空气炸锅", "电饭煲 电饭锅", "蒸锅 蒸箱", "平底锅", "高压锅 压力锅",
                               "炒锅", "电烤盘")

#: Words jieba tags as names that are ordinary words (东西 "things" as a place, 银行卡 as a person):
#: not entities.
NOT_NAMES = frozenset("东西 银行卡 信用卡 储蓄卡 小狗 小猫 狗狗 猫咪 宝宝 日志 小孩 小区".split())

#: Words that negate like the negation characters (拒绝退还 asks what 不退 asks).
NEGATION_WORDS = ("拒绝", "拒不", "失败")

#: Words that contain an audience word without naming that audience (一个人 is "one person",
#: 个人信息 "personal data"): masked before audiences are read.
NOT_AUDIENCES = ("一个人", "两个人", "几个人", "每个人", "个人信息", "个人资料", "个人中心", "个人主页", "个人账户",
                 "个人设置", "个人所得税", "个税")

#: Politeness and hedging that open a question and change no answer.
FILLER_PHRASES = ("麻烦问一下", "麻烦问下", "我想问一下", "想问一下", "想问下", "请问一下", "请教一下", "打扰一下",
                  "有人知道", "有谁知道", "大家好", "你好", "您好", "请问", "请教", "在吗", "谢谢", "多谢", "求助", "求问")

#: The same product or service named in Latin letters and in Chinese (or two spellings): one
#: side's name is named by the other when it has any name of the group.
ALIASES: tuple[tuple[str, ...], ...] = (
    ("iphone", "苹果手机"), ("ipad", "苹果平板"), ("mac", "macbook", "苹果电脑"), ("apple", "苹果"),
    ("wechat", "微信"), ("alipay", "支付宝"), ("taobao", "淘宝"), ("huawei", "华为"), ("xiaomi", "小米"),
    ("kubernetes", "k8s"), ("javascript", "js"), ("typescript", "ts"), ("vscode", "vs code", "visual studio code"),
    ("wifi", "wi-fi", "无线网", "无线网络"), ("powerpoint", "ppt"), ("u盘", "usb"), ("cpu", "处理器"),
    ("gpu", "显卡"), ("windows", "win"), ("postgresql", "postgres"), ("golang", "go语言"), ("c++", "cpp"),
    ("tiktok", "抖音"), ("didi", "滴滴"), ("meituan", "美团"), ("jd", "京东"),
    # international brands and their Chinese names
    ("microsoft", "微软"), ("google", "谷歌"), ("amazon", "亚马逊"), ("samsung", "三星"), ("lenovo", "联想"),
    ("dell", "戴尔"), ("hp", "惠普"), ("canon", "佳能"), ("epson", "爱普生"), ("sony", "索尼"), ("nintendo", "任天堂"),
    ("intel", "英特尔"), ("nvidia", "英伟达"), ("tesla", "特斯拉"), ("bmw", "宝马"), ("mercedes", "benz", "奔驰"),
    ("toyota", "丰田"), ("honda", "本田"), ("volkswagen", "vw", "大众"), ("ikea", "宜家"), ("starbucks", "星巴克"),
    ("mcdonald's", "mcdonalds", "麦当劳"), ("kfc", "肯德基"), ("nike", "耐克"), ("adidas", "阿迪达斯"),
    ("uber", "优步"), ("airbnb", "爱彼迎"), ("netflix", "网飞", "奈飞"), ("youtube", "油管"), ("facebook", "脸书"),
    ("twitter", "推特"), ("instagram", "ig", "ins"), ("linkedin", "领英"), ("telegram", "电报"),
    ("duolingo", "多邻国"), ("binance", "币安"), ("paypal", "贝宝"), ("costco", "开市客"), ("walmart", "沃尔玛"),
    ("marriott", "万豪"), ("hilton", "希尔顿"), ("hyatt", "凯悦"), ("ebay", "易贝"), ("alibaba", "阿里巴巴", "阿里"),
    ("tencent", "腾讯"), ("baidu", "百度"), ("pinduoduo", "拼多多"), ("xiaohongshu", "小红书"), ("bilibili", "b站", "哔哩哔哩"),
    ("weibo", "微博"), ("qq", "企鹅"), ("kyc", "实名认证", "身份认证"),
)
#: Brands and the products that name them: a text that names an iPhone names 苹果 (not the other
#: way round: 苹果手机 does not name an iPad).
BRAND_PRODUCTS: dict[str, tuple[str, ...]] = {
    "苹果": ("iphone", "ipad", "mac", "macbook", "airpods", "apple"), "华为": ("mate", "huawei", "鸿蒙", "harmonyos"),
    "小米": ("xiaomi", "redmi", "红米", "miui"), "微软": ("windows", "microsoft", "office", "xbox"),
    "谷歌": ("google", "android", "安卓", "gmail", "chrome"),
}
#: Latin words in Chinese text that are not names (they are everywhere, in many products).
GENERIC_LATIN = frozenset({"app", "apps", "vip", "id", "ok", "diy", "faq", "pro", "max", "plus", "mini"})

#: Question words of the same meaning, mapped to one (怎么 / 如何 / 怎样 all ask "how").
QUESTION_WORDS = {"怎么": "how", "如何": "how", "怎样": "how", "怎么样": "how", "咋": "how", "怎么办": "how",
                  "为什么": "why", "为何": "why", "干嘛": "why", "什么": "what", "啥": "what",
                  "哪里": "where", "哪儿": "where", "什么地方": "where", "多少": "howmuch", "几": "howmuch",
                  "多久": "howlong", "什么时候": "when", "何时": "when", "哪个": "which", "哪些": "which",
                  "能否": "can", "能不能": "can", "可不可以": "can", "是否可以": "can", "可以": "can", "能": "can",
                  "是否": "whether", "是不是": "whether", "有没有": "whether", "吗": ""}

#: Words that carry little of a question's meaning: particles, pronouns, politeness, fillers.
FUNCTION_WORDS = frozenset("""
的 了 吗 呢 吧 啊 呀 哦 嘛 么 着 过 地 得 之 和 与 及 或 或者 还是 就 都 也 还 又 再 才 很 太 挺 比较 一下
我 我的 我们 你 你的 您 您的 你们 他 她 它 他们 这 这个 这些 那 那个 那些 该 自己 本人
请 请问 麻烦 问 问下 问一下 想问 想问一下 我想 想 想知道 知道 一下子 你好 您好 谢谢 谢了 多谢 劳驾 打扰
在 是 有 要 会 去 到 把 被 给 让 对 从 向 为 以 于 用 做 弄 搞 下 个 吧 呀 嗯 哈 诶 额 那么 这样 这么 那样
应该 需要 得 必须 一般 通常 平时 现在 目前 然后 呢 啦 哇 里 上 中
""".split())

#: Single characters of opposite meaning. Two texts that differ only in one or two characters, one
#: of them such a pair at the same place (大码 / 小码, 早班 / 晚班), ask opposite questions:
#: ``chinese.char_antonym_refusal``.
CHAR_ANTONYMS: tuple[str, ...] = (
    "大小", "高低", "多少", "长短", "新旧", "新老", "快慢", "冷热", "前后", "上下", "早晚", "开关", "进出",
    "买卖", "增减", "升降", "加减", "正负", "内外", "左右", "东西", "南北", "男女", "胖瘦", "深浅", "轻重",
    "远近", "宽窄", "粗细", "厚薄", "强弱", "难易", "贵贱", "明暗", "干湿", "收发", "借还", "首末", "单双", "收付",
)
#: Words that go from a place to a place (从北京到上海, 北京飞上海): ``chinese.route``.
ROUTE_WORDS: tuple[str, ...] = ("到", "至", "去", "飞往", "飞", "开往", "前往")
